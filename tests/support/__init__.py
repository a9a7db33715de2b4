"""What the tests share. Not a test module: pytest collects nothing here, and nothing imports a
`test_*` module or `conftest`.

Where things live, and how a test gets them:

- `fake_hub.py`: `FakeHub`, a local HTTP stand-in for the Hugging Face Hub. Tests take the
  `fake_hub` fixture (a started hub, `huggingface_hub` pointed at it, stopped afterwards);
  tests of the hub itself may also build one (`from support.fake_hub import FakeHub`).
- `reference.py`: the slow, obviously correct numerics (`dequant_block`, `decode_e8m0`,
  `channel_fp8`, `seed_split`, `gaudi_load_time_channel_fp8`, `e4m3_error_bound`, `same_bits`,
  `int4_dequant`).
  Tests take the `reference` fixture (this module) and call `reference.dequant_block(...)` and so on.
- `checkpoints.py`: `load_json`, `load_all` (every tensor of a sharded checkpoint) and
  `tree_hashes` (sha256 of every file under a directory), each a fixture of the same name;
  `SHARD1`, `SHARD2`, two shard names of the tiny checkpoint, are imported.
- `edits.py`: `edit_json`, `edit_header` (a safetensors header changed, its data kept),
  `rewrite_shard`, `drop_tensor` and `shard_of`, for tests that damage a private copy of a
  checkpoint (`src_copy`); imported.
- `cli_runner.py`: `run_cli`, the real CLI in a child process; the `run_cli` fixture.
- `standins/vllm_gaudi/`: a stand-in of vllm-gaudi (see its README). The `vllm_gaudi_standin`
  fixture puts it on `sys.path` for one test and takes it off again.
- `artifacts.py`: `write_artifacts` (MLA artifacts as mla-convert writes them, for given kv_b_proj
  weights; also used by scripts/bench_runtime.py) and `read_artifacts` (a layer's W_UK_T / W_UV
  read back whole); imported, since the test modules' own module-level helpers use them.
- `mistral_layout.py`: `expected_output`, the slow reference of a conversion in Mistral's own layout
  (Mistral-Large-3's and Large-4's tests); imported.
- `serving_034.py`: `serve` (Mistral-Large-4 built by the vllm 0.34.0 stand-in over a model
  directory) and `assert_served_from_artifacts`; imported, with the `v034` fixture.
- `vllm_engine_run.py`: the script the vLLM tests run, one vLLM engine per subprocess (greedy
  tokens, logprobs, the layers' W_UK_T / W_UV), and the helpers that drive it (`engine_env`,
  `run_engine_process`, `plugin_lines`); the `vllm_installed` fixture fails the group without vLLM.

The fixtures are defined in tests/conftest.py, with the tiny checkpoint (`tiny_src`, `src_copy`)
and its conversions (`converted`), and each family member's tiny checkpoint and conversions
(`family_checkpoints`). The rule: a test takes what it uses as a fixture parameter.
Plain imports from `support` are for constants, for values needed when a module is imported
(`@pytest.mark.parametrize` arguments, hypothesis strategies, default arguments), and for a test
module's own module-level helpers, which fixtures cannot reach. The pure helpers are
session-scoped fixtures, so hypothesis `@given` tests can take them without a health-check
warning.
"""
