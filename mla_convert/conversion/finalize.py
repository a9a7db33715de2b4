"""The last stage of a conversion: side files, the MLA manifest, the model card (README.md, which
takes the place of the source's: output.card), the index (model.safetensors.index.json, or
consolidated.safetensors.index.json) and the config (config.json, or params.json for a member's own
layout), each written atomically and hashed; then the conversion manifest marks the output
complete. What makes a directory a model is written last, as upload sends it last."""

from __future__ import annotations

import json
from pathlib import Path

from mla_convert.constants import CARD_NAME, COMPLETE, MLA_DIR_NAME, MLA_MANIFEST_NAME, TOOL_NAME
from mla_convert.io.files import WrittenFile, copy_file_atomic, write_bytes_atomic
from mla_convert.output.card import with_source_card, write_card
from mla_convert.output.card_facts import CardFacts, SourceRef, source_ref
from mla_convert.output.manifest import write_manifest
from mla_convert.plan.planner import Plan, mla_file_rel
from mla_convert.process.interrupts import crash_point
from mla_convert.source.checkpoint import checked_member
from mla_convert.source.quantization import INT4
from mla_convert.version import __version__
from mla_runtime.format import LayerEntry, MlaManifest


def finalize(plan: Plan, out_dir: Path, files: dict[str, dict], origin: SourceRef | None = None) -> SourceRef:
    """Side files, MLA manifest, the card, index, config, then the manifest 'complete' with every
    file of `files` (the shard jobs' files; the ones written here are added). `origin`: where the
    source came from (default: its directory), for the card and the manifest; returned as recorded
    (with the source card's base_model, where it gave the card one).

    What makes the directory a model comes last, the config after the index (vLLM loads every
    *.safetensors of a directory that has a config and no index): until the config is in place,
    an interrupted run leaves nothing a loader takes for a model (`unmake_model`)."""
    src = plan.source
    origin = origin or source_ref(src.root)

    def record(rel: str, w: WrittenFile) -> None:
        files[rel] = {"size": w.size, "sha256": w.sha256}

    card = plan.options.card
    for rel in src.side_files:
        if not (card and rel == CARD_NAME):  # the card takes the source's README's place
            record(rel, copy_file_atomic(checked_member(src.root, rel, "side file"), out_dir / rel))
    layers = tuple(
        LayerEntry(
            i,
            Path(mla_file_rel(i)).name,
            files[mla_file_rel(i)]["size"],
            files[mla_file_rel(i)]["sha256"],
            src.own_dims(i),
        )
        for i in plan.mla_layers
    )
    manifest = MlaManifest(
        dims=src.dims,
        layers=layers,
        source_fingerprint=src.fingerprint(),
        producer={"tool": TOOL_NAME, "version": __version__, "format": plan.options.format},
    )
    rel = f"{MLA_DIR_NAME}/{MLA_MANIFEST_NAME}"
    crash_point("mla-manifest")
    record(rel, write_bytes_atomic(out_dir / rel, manifest.to_json().encode()))
    facts = None
    if card:
        source_card = checked_member(src.root, CARD_NAME, "side file") if CARD_NAME in src.side_files else None
        origin = with_source_card(origin, source_card)
        facts = card_facts(plan, origin)
        record(CARD_NAME, write_card(out_dir, facts, source_card))
    weight_map = {t.name: job.file for job in plan.shards for t in job.tensors}
    total = sum(job.out_bytes for job in plan.shards)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    crash_point("index")
    record(plan.index_name, write_bytes_atomic(out_dir / plan.index_name, _json_bytes(index)))
    crash_point("config")
    record(plan.config_name, write_bytes_atomic(out_dir / plan.config_name, _json_bytes(plan.config)))
    crash_point("final-manifest")
    record_facts = facts.record() if facts is not None else None
    write_manifest(out_dir, COMPLETE, plan.options.as_dict(), src.fingerprint(), files, origin.as_dict(), record_facts)
    return origin


def unmake_model(plan: Plan, out_dir: Path) -> None:
    """Remove the config and the index that an earlier, interrupted run of this conversion wrote
    (the manifest already says incomplete): a --resume cut short leaves no loadable-looking model.
    finalize writes both again, the same bytes."""
    for rel in (plan.config_name, plan.index_name):
        (out_dir / rel).unlink(missing_ok=True)


def card_facts(plan: Plan, origin: SourceRef) -> CardFacts:
    src, options = plan.source, plan.options
    summary = plan.summary()
    return CardFacts(
        source=origin, fingerprint=src.fingerprint(), version=__version__, format=options.format,
        target=options.target, fp8_max=options.fp8_max, ignore=options.ignore, architecture=src.layout.architecture,
        model_type=str(src.config.get("model_type")), layers=src.layout.layers, mtp_layers=src.layout.mtp_layers,
        heads=src.dims.num_heads, mla_layers=len(plan.mla_layers), shards=len(plan.shards),
        tensors=summary["tensors_out"], model_bytes=summary["bytes_out_model"], mla_bytes=summary["bytes_out_mla"],
        ignored_modules=len(plan.ignored_modules), config_name=plan.config_name, int4_experts=src.quant.kind == INT4,
    )  # fmt: skip


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
