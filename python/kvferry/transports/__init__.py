"""kvferry's transports: one module per transport (in-process, shared memory, CUDA IPC,
staging, NIXL) behind the contract in `kvferry.transports.base`, the socket machinery the
cross-process ones share in `kvferry.transports.control` (over the control channel of
`kvferry.transports.wire`, carrying the frames of `kvferry.transports.frames`; README.md in
this folder gives the reading order), and `kvferry.transports.registry`, the one table of
which transports exist, where each runs, and how to build a receiver's endpoint and a
sender's transport from a name or URL. The registry imports no transport (nor torch) until one is
built, so the CLI reads it without torch; each transport module names the missing extra."""
