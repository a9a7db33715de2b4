"""A config field the converter reads, of a type it cannot interpret, is refused before the first
byte: one line naming the field (as the member's config file spells it) and the
type it expected, exit 2, nothing written. Every field the converter reads (source/family.py's
ModelLayout and inventory, source/shapes.py, the members' own readings, the quantization_config,
mla_runtime/model_configs.py for params.json) given each wrong type: a list, a string, a float, a
bool, null and a negative number (each that is wrong for the field: null is a value of the
optional ones)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.cli_runner import cli_error

WRONG = {"a list": [1, 2], "a string": "8", "a float": 1.5, "a bool": True, "null": None, "negative": -4}
OPTIONAL = ("a list", "a string", "a float", "a bool", "negative")  # null means absent: the default
NOT_INTEGERS = ("a list", "a string", "a float", "a bool")  # negative and null may be values of it
FLAG = ("a list", "a string", "a float", "negative")  # a bool field; null: false

# member -> {field path in its config file (dots into objects): the wrong values to try}
MLA = ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
       "qk_rope_head_dim", "v_head_dim")  # fmt: skip
COUNTS = ("q_lora_rank", "num_nextn_predict_layers", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
          "moe_layer_freq", "vocab_size", "intermediate_size", "moe_intermediate_size")  # fmt: skip
MISTRAL_MLA = ("dim", "n_layers", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
MISTRAL_MOE = ("moe.num_experts", "moe.expert_hidden_dim", "moe.first_k_dense_replace", "moe.route_every_n")
OBJECT = ("a list", "a string", "a float", "a bool", "negative")
TEXT = ("a list", "a float", "a bool", "negative")
LIST = ("a string", "a float", "a bool", "negative")

# member -> {field path in its config file (dots into objects): the wrong values to try}
FIELDS = {
    "deepseek-v3": {
        **dict.fromkeys(MLA, tuple(WRONG)),
        **dict.fromkeys(COUNTS, OPTIONAL),
        "tie_word_embeddings": FLAG,
        "topk_method": TEXT,
        "architectures": LIST,
        "model_type": TEXT,
        "mlp_layer_types": LIST,
        "quantization_config": OBJECT,
        "quantization_config.weight_block_size": ("a string", "a float", "a bool", "null", "negative"),
        "quantization_config.quant_method": TEXT,
    },
    "deepseek-v3.2": dict.fromkeys(("index_n_heads", "index_head_dim"), tuple(WRONG)),
    "glm-5": {"indexer_types": LIST, "index_topk_freq": OPTIONAL},
    "kimi-k2.5": {
        "text_config": OBJECT,
        "text_config.num_attention_heads": tuple(WRONG),
        "text_config.n_routed_experts": OPTIONAL,
    },
    "mistral-large-3": {
        **dict.fromkeys(MISTRAL_MLA, tuple(WRONG)),
        **dict.fromkeys(("hidden_dim", "vocab_size", "q_lora_rank"), OPTIONAL),
        "moe": OBJECT,
        **dict.fromkeys(MISTRAL_MOE, OPTIONAL),
        "tied_embeddings": FLAG,
    },
    "mistral-large-4": {
        "dsa": ("a list", "a string", "a float", "negative"),
        **dict.fromkeys(("dsa.n_heads", "dsa.head_dim", "dsa.topk"), tuple(WRONG)),
        "dsa.sharing": TEXT,
        "nope": TEXT,
        "kv_sharing": OBJECT,
        "kv_sharing.source_layers_str": TEXT,
        "ssmax_scaling": FLAG,
        "lerope": FLAG,
    },
}
CONFIG_FILE = {"mistral-large-3": "params.json", "mistral-large-4": "params.json"}
# The default group tries each field with one of its wrong types (taken in turn); `slow` the rest.
CASES = [
    pytest.param(m, f, w, id=f"{m}:{f}={w}", marks=() if k == n % len(wrongs) else pytest.mark.slow)
    for m, fields in FIELDS.items()
    for n, (f, wrongs) in enumerate(fields.items())
    for k, w in enumerate(wrongs)
]


def _set(doc: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        doc = doc[key]
    doc[last] = value


@pytest.mark.parametrize(("member", "field", "wrong"), CASES)
def test_a_config_field_of_the_wrong_type_is_refused_naming_it(family_checkpoints, tmp_path, member, field, wrong):
    src = Path(shutil.copytree(family_checkpoints.source(member), tmp_path / "src"))
    path = src / CONFIG_FILE.get(member, "config.json")
    doc = json.loads(path.read_text())
    _set(doc, field, WRONG[wrong])
    path.write_text(json.dumps(doc))
    out = tmp_path / "out"
    line = cli_error(["convert", src, "--out", out], out)  # exit 2, one line, nothing at out
    name = field.removeprefix("text_config.").removeprefix("quantization_config.")  # as its messages name them
    # a null dsa key is one missing: "dsa lacks index_topk", in the spelling vLLM's aliases map to
    said = {"dsa.topk": "index_topk", "dsa.n_heads": "index_n_heads", "dsa.head_dim": "index_head_dim"}.get(field)
    said = said if wrong == "null" else None
    assert str(path) in line and (said or name) in line, line
