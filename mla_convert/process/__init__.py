"""The process a command runs in: its heap policy (`heap`), Ctrl-C held back where helper threads
work on the caller's memory (`interrupts`), and the worker processes (`workers`)."""
