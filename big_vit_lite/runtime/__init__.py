"""Shared plumbing: devices, processes, meshes and sharding, paths, host memory, FLOPs."""
