"""The offline demo (`run`): a tiny checkpoint of a family member written, converted and verified;
and the checkpoints it and the tests and benchmarks are made of (`synthetic`)."""
