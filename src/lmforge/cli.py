"""The ``lmforge`` command: ``lmforge TRAINER --config FILE [--section.key=value ...]`` and tools.

The trainers are the registered recipes (:mod:`lmforge.recipes`); adding one needs no change here.

User errors (bad config, missing files, ...) print one ``error:`` line and exit with status 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Callable

from lmforge.errors import UserError

def _train(name: str, argv: list[str]) -> int:
    """``lmforge NAME --config FILE --key=value``: :func:`lmforge.api.train`, whose config is read and
    checked before torch is imported (a config error answers at once)."""
    from lmforge.api import train
    from lmforge.config import parse_overrides
    from lmforge.recipes import get_recipe

    recipe = get_recipe(name)
    parser = argparse.ArgumentParser(prog=f"lmforge {name}", description=f"{name}: {recipe.summary}.",
                                     epilog="Any config key can be overridden: --training.steps=50")
    parser.add_argument("--config", help="TOML config file (configs/*.toml)")
    args, overrides = parser.parse_known_args(argv)
    from lmforge.process import PROCESS_START

    run = train(name, args.config, parse_overrides(overrides), started=PROCESS_START)
    if os.environ.get("RANK", "0") == "0":
        print(run_files_note(run.run_dir))
    return 0


def run_files_note(run_dir: os.PathLike | str) -> str:
    """The two lines a finished training ends with: where its files are, how to view them."""
    return (f"run files: {run_dir}/ (metrics.jsonl, config.toml, checkpoints/, tensorboard/)\n"
            f"view in TensorBoard: tensorboard --logdir {run_dir}/tensorboard")


def _generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge generate", description="Sample from a checkpoint.")
    p.add_argument("checkpoint", help="run directory, checkpoint directory, Hugging Face model directory or .gguf file")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--tokenizer", default="byte",
                   help="directory of Hugging Face tokenizer files (needed for a .gguf file)")
    p.add_argument("--image", action="append", metavar="FILE",
                   help="an image shown before the prompt (repeat for several; a vision-language model, chat format)")
    a = p.parse_args(argv)
    from lmforge.inference import load_for_inference, sample_texts, sample_with_images

    model, tokenizer = load_for_inference(a.checkpoint, tokenizer=a.tokenizer)
    if a.image:
        if len(a.prompt) != 1:
            p.error("--image goes with one --prompt")
        print(sample_with_images(model, tokenizer, a.prompt[0], a.image, max_new_tokens=a.max_new_tokens,
                                 temperature=a.temperature, top_p=a.top_p, seed=a.seed))
        return 0
    for text in sample_texts(model, tokenizer, a.prompt, max_new_tokens=a.max_new_tokens,
                             temperature=a.temperature, top_p=a.top_p, seed=a.seed, chat=a.chat):
        print(text)
    return 0


def _export(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge export", description="Export a checkpoint.")
    p.add_argument("--hf", metavar="OUT_DIR", help="write a Hugging Face model directory here (config.json, "
                   "safetensors, tokenizer); a LoRA run's adapters are merged into it")
    p.add_argument("--gguf", metavar="FILE", help="write a llama.cpp GGUF file here (weights, tokenizer, chat "
                   "template); a LoRA run's adapters are merged into it")
    p.add_argument("--gguf-type", default="f16", metavar="TYPE",
                   help="GGUF tensor type: f16 (default), bf16, q8_0 or f32")
    p.add_argument("--adapter", metavar="OUT_DIR", help="LoRA runs: write a PEFT adapter directory here")
    p.add_argument("--base", metavar="OUT_DIR", help="with --adapter: also write the adapter's base model here "
                   "(required unless the run started from a Hugging Face directory)")
    p.add_argument("run_dir", help="run directory or checkpoint directory (--gguf: also a Hugging Face directory)")
    a = p.parse_args(argv)
    if not a.hf and not a.adapter and not a.gguf:
        p.error("give --hf OUT_DIR, --gguf FILE and/or --adapter OUT_DIR")
    if a.base and not a.adapter:
        p.error("--base goes with --adapter")
    from lmforge.exporters import export_adapter, export_gguf, export_hf

    if a.gguf:  # first: it checks its arguments (type, file) before anything is written
        print(f"exported GGUF ({a.gguf_type}) to {export_gguf(a.run_dir, a.gguf, a.gguf_type)}")
    if a.hf:
        print(f"exported Hugging Face model to {export_hf(a.run_dir, a.hf)}")
    if a.adapter:
        print(f"exported PEFT adapter to {export_adapter(a.run_dir, a.adapter, a.base)}")
        if a.base:
            print(f"exported its base model to {a.base}")
    return 0


def _eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge eval", description="Score a model with the lm-evaluation-harness.",
                                epilog="Task data must be local: --include-path DIR holds task YAMLs with data_files.")
    p.add_argument("model", help="run directory, checkpoint directory, or Hugging Face model directory")
    p.add_argument("--tasks", required=True, help="comma-separated harness task or group names (lmforge_tasks: "
                   "the embedded tasks)")
    p.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if below 1)")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--apply-chat-template", dest="chat", action="store_true", default=None,
                      help="format prompts with the model's chat template (default: only for lmforge_* tasks)")
    chat.add_argument("--no-chat-template", dest="chat", action="store_false", help="never apply it")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--include-path", help="a directory of task YAMLs (data_files with local paths)")
    p.add_argument("--out", help="write the results JSON here (default: RUN_DIR/eval/results_<time>.json)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    a = p.parse_args(argv)
    from lmforge.evaluation.harness import require_lm_eval

    require_lm_eval()  # before loading the model: say at once what to install
    from lmforge.evaluation.harness import run_eval

    return run_eval(a.model, a.tasks.split(","), limit=a.limit, apply_chat_template=a.chat,
                    batch_size=a.batch_size, include_path=a.include_path, out=a.out, device=a.device)


def _prepare(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge prepare", description="Tokenize text once into token shards that "
                                "data.train / data.sources read (memory-mapped).")
    p.add_argument("inputs", nargs="*", metavar="INPUT", help=".txt/.jsonl/.parquet file, directory of them, or a "
                   "datasets directory (save_to_disk)")
    p.add_argument("--out", required=True, help="the prepared directory to write (or to check, with --verify)")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a directory holding tokenizer.json (default: byte)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1), help="tokenizing processes")
    p.add_argument("--text-field", default="text", help="JSONL field / parquet or datasets column of the text")
    p.add_argument("--shard-tokens", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--verify", action="store_true", help="hash every byte of --out against its index and exit")
    a = p.parse_args(argv)
    if a.verify:
        from lmforge.data.shards import PreparedTokens

        problems = PreparedTokens(a.out).verify()
        if problems:
            raise UserError(f"{a.out} is damaged: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        print(f"{a.out}: every shard matches its checksum")
        return 0
    if not a.inputs:
        raise UserError("lmforge prepare: give at least one INPUT (or --verify to check --out)")
    if a.workers < 1:
        raise UserError(f"--workers must be at least 1, got {a.workers}")
    from lmforge.data.prepare import prepare
    from lmforge.data.shards import SHARD_TOKENS
    from lmforge.models.tokenizer import load_tokenizer

    prepare(a.inputs, a.out, load_tokenizer(a.tokenizer), tokenizer_spec=a.tokenizer, workers=a.workers,
            text_field=a.text_field, shard_tokens=a.shard_tokens or SHARD_TOKENS)
    return 0


def _plan(argv: list[str]) -> int:
    from lmforge.planning.plan_command import main as plan_main
    return plan_main(argv)


def _report(argv: list[str]) -> int:
    from lmforge.metrics.report import main as report_main
    return report_main(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "generate": _generate, "export": _export, "report": _report, "eval": _eval, "prepare": _prepare,
    "plan": _plan,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from lmforge.recipes import recipes

    trainers = recipes()
    usage = (f"usage: lmforge {{{','.join(trainers)}}} --config FILE [--section.key=value ...]\n"
             "       lmforge generate CHECKPOINT --prompt TEXT | export --hf OUT [--gguf FILE] [--adapter OUT] RUN_DIR | report RUN_DIR...\n"
             "       lmforge eval RUN_OR_MODEL_DIR --tasks T1,T2 [--limit N] [--apply-chat-template]\n"
             "       lmforge prepare INPUT... --out DIR [--tokenizer T] [--workers N] [--text-field F] | --out DIR --verify\n"
             "       lmforge plan --devices N [--device-memory-gb G] [--json] [--section.key=value ...]")
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, trainers))
        print(usage + "\n\ntrainers:\n" + "\n".join(f"  {n:<{width}}  {r.summary}" for n, r in trainers.items()))
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd in trainers:
            return _train(cmd, rest)
        if cmd in COMMANDS:
            return COMMANDS[cmd](rest)
        print(f"error: unknown command {cmd!r}\n{usage}", file=sys.stderr)
        return 2
    except UserError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        # Path.exists() and friends raise it (they swallow only "no such file"), from any key naming a path
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:60]}...{name[-16:]} ({len(name)} characters)"
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {shown}: file name too long for the file system", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
