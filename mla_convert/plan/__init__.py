"""The plan of a conversion, from headers alone: what each output shard holds, which source tensors
it needs (`planner`), what happens to each (`ops`), and the output config (`output_config`)."""
