"""The source checkpoint: which architectures convert (`family`), a checkpoint validated from its
headers (`checkpoint`), SOURCE resolved to a directory or a Hub repo (`resolve`), and the Hub
client's side of it (`hub`)."""
