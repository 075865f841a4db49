"""DPO with image prompts: both sequences of a pair carry the prompt's images (rows of pairs keep them with
their documents), the policy's and reference's sequence log-probs are the model's forward with the images,
and ``lmforge dpo`` trains a vision-language model on such records."""

from __future__ import annotations

import json

import torch

from _helpers import lmforge_in_process
from lmforge.data.chat import chat_format_for
from lmforge.data.image_tokens import image_encoding_for
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.preference_data import build_preference_dataset, read_preference_records
from lmforge.data.shape_task import shape_example
from lmforge.metrics.records import read_records
from lmforge.models.args import model_args_for
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.objectives.pairwise import sequence_logprobs


def pairs_file(tmp_path, n: int = 4):
    rows = []
    for i in range(n):
        ex = shape_example("train", i)
        ex.image().save(tmp_path / f"{i}.png")
        wrong = "blue" if ex.colour != "blue" else "red"
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "path": f"{i}.png"},
                                                             {"type": "text", "text": "colour?"}]}],
                     "chosen": [{"role": "assistant", "content": ex.colour}],
                     "rejected": [{"role": "assistant", "content": wrong}]})
    f = tmp_path / "pairs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_pairs_carry_the_prompt_images_and_logprobs_see_them(tmp_path):
    tok = ByteTokenizer()
    args = model_args_for("qwen2.5-vl-debug", tok.vocab_size)
    model = spec_for_args(args).build(args)
    model.init_weights(0)
    model.eval()
    f = pairs_file(tmp_path, 2)
    ds, summary = build_preference_dataset(read_preference_records(str(f)), str(f), tok, chat_format_for(tok),
                                           seq_len=128, images=image_encoding_for(args, tok))
    assert summary.pairs == 2 and len(ds) == 1
    row = ds[0]
    assert row.image_grid_thw.shape[0] == 4  # two pairs, the image in both sequences of each
    with torch.no_grad():
        got = sequence_logprobs(model, collate([row]))
        want = []
        for k in range(4):  # each sequence alone, its own image, from the model's forward
            ex = ds.examples[k]
            pix, grid = ds.images.process(ex.images)
            logits = model(torch.from_numpy(ex.input_ids)[None], pixel_values=pix, image_grid_thw=grid)
            labels = torch.from_numpy(ex.labels)
            mask = labels != IGNORE_INDEX
            want.append(logits[0].log_softmax(-1)[mask].gather(1, labels[mask, None]).sum())
    torch.testing.assert_close(got, torch.stack(want), atol=1e-4, rtol=1e-5)


def test_dpo_trains_a_vlm_on_image_pairs(tmp_path):
    f = pairs_file(tmp_path, 8)
    run = tmp_path / "run"
    assert lmforge_in_process("dpo", "--model.size=qwen2.5-vl-debug", "--model.tokenizer=byte", f"--data.train={f}",
                              "--data.validation=none", "--data.seq_len=128", "--training.steps=2",
                              "--training.global_batch_size=2", "--training.micro_batch_size=2", f"--run.dir={run}",
                              "--metrics.tensorboard=false", "--metrics.progress=off", "--metrics.peak_tflops=1",
                              "--eval.interval=0", "--dpo.task_eval=false") == 0
    steps = [r for r in read_records(run, "train") if "loss" in r]
    assert steps and all(r["loss"] == r["loss"] for r in steps)  # finite losses on image pairs
