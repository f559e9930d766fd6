"""kvferry's transports: one module per transport (in-process, shared memory, CUDA IPC over
local sockets, staging, NIXL) behind the contract in `kvferry.transports.base`."""
