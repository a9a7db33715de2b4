"""A conversion: the pipeline as named stages (`pipeline`), the shard job (`shard_job`), the
schedulers that run the jobs (`schedulers`), how the arithmetic runs (`compute`), the source's
scale checks (`scales`), the last stage (`finalize`), and the test seam of crash points."""
