"""What is on storage: the layout, the manifest, the tree codec, the safetensors
header, and the hashes (CRC32C, XXH3-128)."""
