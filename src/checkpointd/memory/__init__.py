"""Host memory, below the readers and the writers: CPU bytes copied on the free cores
(with CRC32C as they land) and host buffers for loaded tensors, faulted in bulk."""
