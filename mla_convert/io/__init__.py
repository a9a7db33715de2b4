"""Files: crash-safe small files without torch (`files`), safetensors headers (`headers`) and
tensor reads (`tensors`), the streaming shard writer (`shard_writer`), direct or buffered disk
writes (`disk_write`), and read-ahead (`read_ahead`)."""
