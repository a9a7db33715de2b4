"""The body of the output's model card (output.card): Markdown, one function per section.

The same conversion gives the same text (no dates, no host names): the card is part of the output,
and the tests compare whole output trees. The accuracy table is the README's ("Serving with
vLLM"), from scripts/accuracy_runtime.py. What the card says of the output's format (its words, its
weights section, its serving note, its target's note) is the format's (formats.Format.card_*).
"""

from __future__ import annotations

from mla_convert import formats
from mla_convert.constants import MANIFEST_NAME, MLA_DIR_NAME, PARAMS_JSON_NAME
from mla_convert.output.card_facts import CardFacts
from mla_convert.results import VerifyReport
from mla_convert.units import gb

# The verification section lies between these, so that a verify result can be put in later
# (output.card.record_verification).
VERIFY_BEGIN, VERIFY_END = "<!-- mla-convert:verify -->", "<!-- /mla-convert:verify -->"
SOURCE_HEADING = "# The source's model card"
# The source's card follows this line, as it is: `mla-convert card` takes it from here.
SOURCE_BEGIN = "<!-- mla-convert:source-card -->"
PACKAGE = "mla-convert"  # the Python package, installed from its source repository

# README, "Serving with vLLM": relative error of the absorbed weights against the exact value of the
# source kv_b_proj (scripts/accuracy_runtime.py, R1's kv_b_proj shape, on a CPU).
ACCURACY_ROWS = (
    ("DeepSeek's block FP8 (requantized to channel FP8 at every start; artifacts via `MLA_RUNTIME_DIR`)",
     "2.61 %", "0.17 %"),
    ("the same with `VLLM_HPU_FORCE_CHANNEL_FP8=false`", "0.23 %", "0.17 %"),
    ("mla-convert channel FP8", "2.61 %, every weight scaled by 0.998", "0.17 %"),
    ("mla-convert bf16", "0.17 %", "0.17 %"),
    ("Gaudi2: block FP8, or channel FP8 of either target", "2.61-2.62 %", "0.17 %"),
)  # fmt: skip


def body(facts: CardFacts, source_text: str | None) -> str:
    """Every section, then the source's card (when the source has one) under SOURCE_HEADING."""
    text = "\n\n".join(sections(facts, source_text is not None))
    source_text = (source_text or "").strip("\n")
    return f"{text}\n\n{source_text}\n" if source_text else f"{text}\n"


def sections(facts: CardFacts, with_source_card: bool) -> list[str]:
    """What mla-convert writes of the body, section by section (no newline around each): the last,
    with a source card, is its heading down to SOURCE_BEGIN; the source's card follows it. The
    user's text around them is kept when the card is written again (output.card_edits)."""
    parts = [
        _title(facts, with_source_card),
        _conversion(facts),
        _weights(facts),
        _artifacts(facts),
        _serving(facts),
        _verification(facts),
        _not_verified(facts),
    ]
    if with_source_card:
        parts.append(_source_heading(facts))
    return [p.strip("\n") for p in parts]


def section_name(section: str) -> str:
    """A section as a message names it: its heading line."""
    return next((ln for ln in section.splitlines() if ln.startswith("#")), section.split("\n", 1)[0])


def _format(facts: CardFacts) -> formats.Format:
    return formats.get(facts.format)


def _format_words(facts: CardFacts) -> str:
    return _format(facts).card_words(facts.target, facts.fp8_max)


def model_name(facts: CardFacts) -> str:
    """The model as the card's title names it: the repo's name, else its base model's with the
    format, else its architecture's (never a local directory's name)."""
    if facts.repo_id:
        return facts.repo_id.rsplit("/", 1)[-1]
    base = facts.source.base_model
    words = _format(facts).words
    return f"{base.rsplit('/', 1)[-1]}, {words}" if base else f"{facts.architecture}, {words}"


def _what(facts: CardFacts) -> str:
    base = facts.source.base_model
    return f"[`{base}`](https://huggingface.co/{base})" if base else f"A `{facts.architecture}` checkpoint"


def _title(facts: CardFacts, with_source_card: bool) -> str:
    return (
        f"# {model_name(facts)}\n\n"
        f"{_what(facts)} converted to {_format_words(facts)} by mla-convert {facts.version}, with "
        f"every MLA layer's `W_UK_T` / `W_UV` precomputed under `{MLA_DIR_NAME}/`, for serving with vLLM "
        "(vllm-gaudi on Intel Gaudi, or any other vLLM build)."
        + (" The source's own model card is kept at the end; it describes the source's weights, not these."
           if with_source_card else "")
    )  # fmt: skip


def _conversion(facts: CardFacts) -> str:
    revision = f" at commit `{facts.source.revision}`" if facts.source.revision else ""
    mtp = f" + {facts.mtp_layers} MTP" if facts.mtp_layers else ""
    ignore = ", ".join(f"`{p}`" for p in facts.ignore) or "none"
    flags = _format(facts).card_flags(facts.target)
    flags += "".join(f" --ignore '{p}'" for p in facts.ignore)
    rows = [
        ("source", _source_row(facts, revision)),
        ("source fingerprint", f"`{facts.fingerprint}` (sha256 of its config, index and shard headers)"),
        (
            "architecture",
            f"`{facts.architecture}` (`{facts.model_type}`), {facts.layers}{mtp} layers, {facts.heads} attention heads",
        ),
        ("format", _format_words(facts)),
        ("`--ignore`", ignore),
        ("converted with", f"mla-convert {facts.version}: `mla-convert convert SOURCE --out DIR{flags}`"),
        (
            "files",
            f"{facts.shards} shards, {facts.tensors} tensors, {gb(facts.model_bytes)}; "
            f"MLA artifacts of {facts.mla_layers} layers, {gb(facts.mla_bytes)}",
        ),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return (
        f"## Conversion\n\n| | |\n|---|---|\n{table}\n\n`{MANIFEST_NAME}` records all of it, with every file's sha256."
    )


def _source_row(facts: CardFacts, revision: str) -> str:
    if facts.source.repo_id:
        return f"`{facts.source.repo_id}`{revision}"
    if facts.source.base_model:
        return f"a local directory; base model `{facts.source.base_model}`"
    return "a local directory (no Hub id recorded)"


def _weights(facts: CardFacts) -> str:
    return _format(facts).card_weights(facts)


def _artifacts(facts: CardFacts) -> str:
    table = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in ACCURACY_ROWS)
    return (
        "## MLA artifacts\n\n"
        f"`{MLA_DIR_NAME}/layer-NNN.safetensors` holds each MLA layer's `W_UK_T` [heads, qk_nope_head_dim, "
        "kv_lora_rank] and `W_UV` [heads, kv_lora_rank, v_head_dim] in bf16, as vllm-gaudi's `HPUMLAAttention` "
        "holds them, computed from the exact value of the *source* `kv_b_proj` and rounded once to bf16; "
        f"`{MLA_DIR_NAME}/manifest.json` lists them with their sha256 and the source fingerprint. `kv_b_proj` "
        "itself stays (vLLM's prefill uses it).\n\n"
        "Without them vllm-gaudi computes the absorbed weights from what its linear method left of "
        "`kv_b_proj`. Relative error against the exact value:\n\n"
        "| served checkpoint (vllm-gaudi defaults) | computed by vllm-gaudi | from the artifacts |\n"
        f"|---|---|---|\n{table}\n\n"
        "From mla-convert's `scripts/accuracy_runtime.py` (R1's `kv_b_proj` shape, synthetic weights), which "
        "runs vllm-gaudi's loading path as re-implemented at a pinned commit, on a CPU. 0.17 % is bf16 "
        "rounding alone."
    )


def mla_fetch_command(repo_id: str, branch: str | None = None) -> str:
    """What puts a repo's mla/ into the Hub cache's snapshot that `vllm serve REPO_ID` reads: vLLM's
    own download leaves it out (it takes the index's shards, or the consolidated ones)."""
    return f"hf download {repo_id}{_revision_flag(branch)} --include '{MLA_DIR_NAME}/*'"


def _revision_flag(branch: str | None) -> str:
    return f" --revision {branch}" if branch and branch != "main" else ""


def _serving(facts: CardFacts) -> str:
    tp = next(t for t in (8, 4, 2, 1) if facts.heads % t == 0)
    cpu = _format(facts).card_serving_note()
    consolidated = facts.config_name == PARAMS_JSON_NAME
    repo, rev = facts.repo_id, _revision_flag(facts.repo_revision)
    served = f"{repo}{rev}" if repo else '"$PWD"'
    if repo:
        block = f"{mla_fetch_command(repo, facts.repo_revision)}\nvllm serve {repo}{rev} --tensor-parallel-size {tp}"
        pattern = "`consolidated*.safetensors`" if consolidated else "the shards its index lists"
        where = (
            f"vLLM downloads `{repo}` into the Hub cache and serves it from there, but its download takes only "
            f"{pattern}, never `{MLA_DIR_NAME}/`: the first line puts `{MLA_DIR_NAME}/` into the same snapshot, "
            "where the plugin finds it (nothing to set; offline, from a cache that holds it, the same). Without "
            "it the plugin says so in one line and vLLM computes the absorbed weights itself"
        )
        name = repo.rsplit("/", 1)[-1]
        local = (
            f"\n\nOr download all of it and serve the directory:\n\n```bash\nhf download {repo}{rev} --local-dir "
            f"./{name}\nvllm serve ./{name} --tensor-parallel-size {tp}\n```"
        )
    else:
        block = f'vllm serve "$PWD" --tensor-parallel-size {tp}'
        where = (
            "Run from this directory, vLLM serves it as it is, and the plugin reads its "
            f"`{MLA_DIR_NAME}/`. `mla-convert upload . OWNER/NAME` publishes it and writes this card for that repo "
            "(the serve line then names it)"
        )
        local = ""
    return (
        "## Serving\n\n"
        f"Install the Python package `{PACKAGE}` (from its source repository, `pip install ./{PACKAGE}` of a "
        "clone) in vLLM's environment: its vLLM plugin, `mla_runtime`, makes every MLA attention layer take "
        f"`W_UK_T` / `W_UV` from the served checkpoint's `{MLA_DIR_NAME}/` instead of computing them. It adds "
        "typer, rich and huggingface_hub there, never torch.\n\n"
        f"```bash\n{block}\n```\n\n{where}.{local}\n\n"
        f"- **Gaudi (vllm-gaudi)**: install vLLM and vllm-gaudi as their documentation says, then the above. "
        f"`--tensor-parallel-size` must divide the {facts.heads} heads; each rank reads only its own heads.\n"
        "- **Other vLLM builds**: a GPU build serves it the same way. vLLM's CPU build: `python -m "
        f"vllm.entrypoints.openai.api_server --model {served} --attention-backend CPU_MLA` "
        "(its `vllm` command "
        f"does not start, and `AMX_MLA` would not read the artifacts).{cpu}\n"
        "- Without the plugin, or with `MLA_RUNTIME_DISABLE=1`, vLLM computes the absorbed weights itself; "
        "the rest of the checkpoint loads the same.\n\n"
        "Each process logs one line such as `mla_runtime: loaded W_UK_T/W_UV of 61/61 MLA layers from "
        ".../mla (TP rank 3 of 8; 61 spot-checked against kv_b_proj)`."
    )


def _verification(facts: CardFacts) -> str:
    return (
        "## Verification\n\n"
        "`mla-convert verify DIR [--source SOURCE]` checks, in groups:\n\n"
        "- **structure**: config, index and shard headers agree; every tensor the config implies is there "
        "with its dtype and shape; `quantization_config`; the MLA manifest;\n"
        f"- **integrity**: every file's size and sha256 as `{MANIFEST_NAME}` records them, nothing unlisted, "
        "and this card's metadata naming the recorded source and format;\n"
        "- **values**: no NaN/Inf, scales finite and > 0, FP8 codes within the target's range;\n"
        "- **source** (with `--source`): every tensor against the source, 16-bit ones bit-exact, channel FP8 "
        "within the e4m3 rounding bound;\n"
        "- **mla**: `W_UK_T` / `W_UV` against the split of `kv_b_proj`, and the absorbed decode path against "
        "the naive one.\n\n"
        f"{VERIFY_BEGIN}\n"
        "**Result**: not run when this card was written (at the end of the conversion). "
        + (
            f"On a download, `mla-convert verify ./{facts.repo_id.rsplit('/', 1)[-1]}` needs no source.\n"
            if facts.repo_id
            else "`mla-convert verify .` in this directory needs no source.\n"
        )
        + f"{VERIFY_END}"
    )


def verify_result(report: VerifyReport) -> str:
    """The verification section's result, from a report of `mla-convert verify`."""
    groups = report.groups.values()
    checks, failed = sum(g.checked for g in groups), sum(g.failed for g in groups)
    verdict = "PASS" if report.ok else f"FAIL ({failed} of {checks} checks failed)"
    against = f" against the source `{report.source}`" if report.source else " without the source"
    rows = "\n".join(
        f"| {name} | {g.checked} | {g.failed} | {f'skipped: {g.skipped}' if g.skipped else 'fail' if g.failed else 'pass'} |"
        for name, g in report.groups.items()
    )
    return (
        f"**Result**: {verdict}: `mla-convert verify` ran {checks} checks{against}.\n\n"
        f"| group | checks | failed | result |\n|---|---|---|---|\n{rows}"
    )


def _not_verified(facts: CardFacts) -> str:
    note = _format(facts).card_target_note(facts.target)
    target_note = f"\n- {note}" if note else ""
    return (
        "## What was not verified\n\n"
        "- No Gaudi hardware was used. Serving on Gaudi, and the accuracy figures above, come from "
        "vllm-gaudi's source read at a pinned commit and run on a CPU with only the Gaudi operations "
        "replaced by plain torch.\n"
        "- Model quality (benchmarks, generations) of this conversion was not measured; the evaluation "
        f"results in the source's card below are the source's.{target_note}"
    )


def _source_heading(facts: CardFacts) -> str:
    name = facts.source.repo_id or facts.source.base_model
    return (
        f"---\n\n{SOURCE_HEADING}\n\n"
        f"Below, unchanged, is the model card of the source{f', `{name}`' if name else ''}. It describes the "
        f"source's weights, not the converted ones above.\n\n{SOURCE_BEGIN}"
    )
