"""The draft-head trainer: equation 1 exactly, training and serving agree, and training really teaches."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from conftest import gloo_threads_at_exit, gloo_threads_left, save_tiny_model

from specdec import LLM, SamplingParams
from specdec.cli import main
from specdec.kv_cache import KVPool
from specdec.models.blocks.attention import AttentionMetadata
from specdec.models.heads.eagle3 import Eagle3Head, default_aux_layers
from specdec.training.losses import head_loss
from specdec.training.targets import target_outputs


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=4)


def random_head(cfg, vocab: int, seed: int = 0) -> Eagle3Head:
    head = Eagle3Head(dataclasses.replace(cfg, num_hidden_layers=1), vocab, default_aux_layers(cfg.num_hidden_layers))
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return head


def test_training_forward_equals_the_serving_forward(target_dir):
    """The differentiable whole-sequence forward and the paged-cache serving path compute the same head."""
    model = LLM(str(target_dir)).engine.model
    head = random_head(model.config, 100)
    ids = list(range(5, 40))
    features, _, _ = target_outputs(model, ids, head.aux_layers)
    T = len(ids) - 1
    embeds = model.embed(torch.tensor(ids[1:])).float()
    with torch.no_grad():
        trained = head.unroll(embeds, features[:T])[0]
    kv = KVPool(head.config, 8, 16, torch.float32, "cpu")
    pos = torch.arange(T)
    slots = (pos + 16)[None]
    served = head(embeds, pos, AttentionMetadata.causal(pos[None], slots, pos[None], slots[0], [T]), kv,
                  features=features[:T])
    assert torch.allclose(trained, served, atol=1e-4)


def test_unrolled_training_steps_equal_serving_draft_steps(target_dir):
    """EAGLE-3's training-time test: step s of the unrolled training forward at row p is exactly what
    serving computes for the s-th draft token after catching up on features 0 .. p - s + 1 (same inputs,
    same keys: the catch-up rows plus the draft rows written before it)."""
    model = LLM(str(target_dir)).engine.model
    head = random_head(model.config, 100, seed=3)
    ids = list(range(7, 40))
    features, _, _ = target_outputs(model, ids, head.aux_layers)
    T = len(ids) - 1
    embeds = model.embed(torch.tensor(ids[1:])).float()
    with torch.no_grad():
        outs = head.unroll(embeds, features[:T], steps=3)
    p = 20
    kv = KVPool(head.config, 8, 16, torch.float32, "cpu")

    def serve(rows: range, **inputs):
        pos = torch.tensor(list(rows))
        ctx = torch.arange(rows.stop)[None]
        meta = AttentionMetadata.causal(pos[None], ctx + 16, ctx, pos + 16, [len(pos)])
        return head(embeds[pos], pos, meta, kv, **inputs)

    caught_up = serve(range(0, p), features=features[:p])  # features 0 .. p - 1
    second = serve(range(p, p + 1), hidden=caught_up[p - 1:p])  # draft token 2 (token p + 1 fed)
    third = serve(range(p + 1, p + 2), hidden=second)  # draft token 3
    assert torch.allclose(outs[0][:p], caught_up, atol=1e-4)
    assert torch.allclose(outs[1][p], second[0], atol=1e-4)
    assert torch.allclose(outs[2][p + 1], third[0], atol=1e-4)


def test_a_batch_of_right_padded_sequences_unrolls_like_each_sequence_alone(target_dir):
    """The GPU trainer unrolls [B, T] batches: each sequence's rows equal its own unroll, whatever padding
    follows it (attention is causal, so padding rows never reach a real row)."""
    model = LLM(str(target_dir)).engine.model
    head = random_head(model.config, 100, seed=5)
    seqs = [list(range(5, 30)), list(range(9, 21)), list(range(3, 33))]
    T = max(len(s) for s in seqs) - 1
    H = model.config.hidden_size
    feats, embs = torch.zeros(len(seqs), T, 3 * H), torch.zeros(len(seqs), T, H)
    alone = []
    for b, ids in enumerate(seqs):
        features, _, _ = target_outputs(model, ids, head.aux_layers)
        n = len(ids) - 1
        embeds = model.embed(torch.tensor(ids[1:])).float()
        feats[b, :n], embs[b, :n] = features[:n], embeds
        feats[b, n:] = 7.0  # garbage padding must not leak into real rows
        with torch.no_grad():
            alone.append(head.unroll(embeds, features[:n], steps=3))
    with torch.no_grad():
        batched = head.unroll(embs, feats, steps=3)
    for b, ids in enumerate(seqs):
        n = len(ids) - 1
        for s in range(3):
            assert torch.allclose(batched[s][b, :n], alone[b][s], atol=1e-5)


def test_loss_is_equation_one_on_a_hand_checked_batch(target_dir):
    """0.1 * CE(target p over the draft vocabulary, head logits) + 1.0 * SmoothL1, on masked rows only."""
    model = LLM(str(target_dir)).engine.model
    head = random_head(model.config, 3)
    head.lm_head.data.zero_()
    head.lm_head.data[0, 0] = 1.0  # head logits: [norm(out)[0], 0, 0]
    head.norm.weight.data.fill_(1.0)
    H = model.config.hidden_size
    out = torch.zeros(2, H)
    out[0, 0] = 2.0  # norm(out)[0] = 2 / sqrt(4 / H + eps)
    target_hidden = torch.zeros(2, H)
    target_hidden[0, 0] = 3.0  # SmoothL1 over row 0: (|2 - 3| - 0.5) / H
    target_logits = torch.full((2, model.config.vocab_size), -1e9)
    target_logits[0, 5], target_logits[0, 7] = 0.0, 0.0  # p = [0.5, 0.5, 0] over draft ids [5, 7, 9]
    loss, stats = head_loss(head, out, target_hidden, target_logits, torch.tensor([True, False]),
                              torch.tensor([5, 7, 9]))
    logq = torch.log_softmax(torch.tensor([2 / (4 / H + head.norm.eps) ** 0.5, 0.0, 0.0]), -1)
    ce = -(0.5 * logq[0] + 0.5 * logq[1])
    assert stats["ce"] == pytest.approx(ce.item(), rel=1e-5)
    assert stats["l1"] == pytest.approx(0.5 / H, rel=1e-5)
    assert loss.item() == pytest.approx(0.1 * ce.item() + 0.5 / H, rel=1e-5)


@pytest.mark.parametrize("method", ["eagle3", "eagle", "mtp"])
def test_training_raises_the_acceptance_length_of_a_head(target_dir, tmp_path, method):
    """A few hundred steps of self-distillation on a tiny random target: the held-out acceptance length
    measured by the serving engine rises well above the untrained head's (which is accepted almost never).
    Not Medusa: its heads start as the identity (Medusa's initialisation), which already guesses this tiny
    target's repetitive greedy text (acceptance length 2.1 untrained); its training on the real model is
    measured in docs/benchmarks-history.md."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then the dog ran to the park".split()
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words) for _ in range(6))},
        {"role": "assistant", "content": "ok"}]}) for _ in range(60)))
    results = {}
    for steps in (1, 600):
        out = tmp_path / f"head{steps}"
        assert main(["train", "--method", method, "--target", str(target_dir), "--data", str(data), "--out", str(out),
                     "--steps", str(steps), "--lr", "1e-2", "--draft-vocab", "320", "--regenerate",
                     "--save-every", "300",
                     "--val-prompts", "4", "--val-tokens", "32"]) == 0
        results[steps] = json.loads((out / "train_log.json").read_text())["validation"]["acceptance_length"]
    assert results[1] < 1.1 and results[600] > results[1] + 0.2, results


def test_resume_continues_from_the_checkpoint(target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                             {"role": "assistant", "content": "the cat sat on the mat"}]}))
    out = tmp_path / "head"
    args = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--draft-vocab", "64",
            "--save-every", "5", "--val-prompts", "0"]
    assert main(args + ["--steps", "5"]) == 0
    first = Eagle3Head.load(out, LLM(str(target_dir)).engine.model.config).state_dict_reference()
    assert main(args + ["--steps", "8", "--resume"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 8 and [h["step"] for h in log["history"]] == [6, 7, 8]
    again = Eagle3Head.load(out, LLM(str(target_dir)).engine.model.config).state_dict_reference()
    assert not torch.equal(first["fc.weight"], again["fc.weight"]) and torch.equal(first["d2t"], again["d2t"])


def test_bad_training_input_is_refused(target_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["train", "--target", str(target_dir), "--data", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "expected a JSON object with a 'messages' list" in capsys.readouterr().err
    assert main(["train", "--method", "lookahead", "--target", str(target_dir), "--data", str(bad),
                 "--out", str(tmp_path / "o")]) == 2
    assert "the trainer supports ['eagle', 'eagle3', 'medusa', 'mtp']" in capsys.readouterr().err


def test_data_lines_may_hold_unicode_line_separators(tmp_path):
    """JSONL splits on newlines only: U+2028 inside a JSON string (seen in our training data) is content."""
    from specdec.training.train import load_conversations

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a\u2028b"},
                                             {"role": "assistant", "content": "c\u2029d"}]}, ensure_ascii=False) + "\n")
    assert load_conversations([str(data)])[0][0]["content"] == "a\u2028b"


def test_feature_cache_gives_the_targets_outputs_in_bfloat16(target_dir, tmp_path):
    """Cached outputs are the target's own, rounded to bfloat16 (features and hidden state: relative error
    below 2^-8 per element; logits recomputed from the rounded hidden state stay within 0.05); a second
    cache over the same samples reuses the shards instead of rerunning the target."""
    from specdec.training.targets import FeatureCache

    model = LLM(str(target_dir)).engine.model
    layers = default_aux_layers(model.config.num_hidden_layers)
    rng = random.Random(0)
    samples = [([rng.randrange(5, 300) for _ in range(rng.randrange(3, 40))], []) for _ in range(5)]
    FeatureCache.SHARD = 2  # several shards, the last one partial
    try:
        cache = FeatureCache(tmp_path, model, layers, samples)
        cache.build()
        assert len(list(cache.dir.glob("shard-*.pt"))) == 3
        for i in (4, 0, 3):  # out of order: shards are reopened
            f, h, lg = cache.outputs(i)
            rf, rh, rl = target_outputs(model, samples[i][0], layers)
            assert torch.allclose(f, rf, rtol=2 ** -8, atol=1e-6) and torch.allclose(h, rh, rtol=2 ** -8, atol=1e-6)
            assert (lg - rl).abs().max() < 0.05
        stamps = [p.stat().st_mtime_ns for p in sorted(cache.dir.glob("shard-*.pt"))]
        again = FeatureCache(tmp_path, model, layers, samples)
        again.build()
        assert again.dir == cache.dir and stamps == [p.stat().st_mtime_ns for p in sorted(cache.dir.glob("shard-*.pt"))]
        assert FeatureCache(tmp_path, model, layers, samples[:4]).dir != cache.dir  # other samples, other key
    finally:
        FeatureCache.SHARD = 64


def test_training_from_the_feature_cache_matches_training_without_it(target_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                       {"role": "assistant", "content": f"the answer is {i}"}]})
                              for i in range(4)))
    logs = []
    for name, extra in (("plain", []), ("cached", ["--feature-cache", str(tmp_path / "features")])):
        out = tmp_path / name
        assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "6",
                     "--draft-vocab", "64", "--val-prompts", "0", *extra]) == 0
        logs.append(json.loads((out / "train_log.json").read_text())["history"])
    assert [h["step"] for h in logs[0]] == [h["step"] for h in logs[1]]
    for a, b in zip(*logs):  # the same run up to bfloat16 rounding of the target's outputs
        assert abs(a["loss"] - b["loss"]) < 0.02 * max(1.0, abs(a["loss"]))


def test_learning_rate_schedule_table():
    """Linear warmup to the peak, then a cosine to a tenth of it at the last step (or constant)."""
    from specdec.training.train import lr_factor

    table = {1: 0.1, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1}
    assert {u: round(lr_factor(u, 110, 10, "cosine"), 6) for u in table} == table
    assert [lr_factor(u, 110, 10, "constant") for u in (5, 10, 60, 110)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(3, 3, 0, "cosine") == pytest.approx(0.1)


def test_warm_start_keeps_shared_weights_and_the_rows_of_shared_draft_tokens(target_dir):
    from specdec.training.train import warm_start

    model = LLM(str(target_dir)).engine.model
    old = Eagle3Head.create("eagle3", model, draft_ids=torch.tensor([5, 7, 9]))
    for p in old.parameters():
        p.data.normal_()
    new = Eagle3Head.create("eagle3", model, draft_ids=torch.tensor([7, 9, 11, 12]))
    warm_start(new, old)
    assert torch.equal(new.fc.weight, old.fc.weight) and torch.equal(new.norm.weight, old.norm.weight)
    assert torch.equal(new.lm_head[:2], old.lm_head[1:])  # tokens 7 and 9
    assert torch.equal(new.lm_head[2:], model.lm_head[torch.tensor([11, 12])].float())  # new tokens: the target's rows
    assert new.target_ids(torch.arange(4)).tolist() == [7, 9, 11, 12]


def test_a_deeper_head_warm_started_from_a_trained_one_begins_with_its_outputs(target_dir):
    """`--num-layers 2 --init ONE_LAYER_HEAD`: the added layer starts as the identity, so every unrolled step of the
    new head equals the old head's, and training moves on from there (the added layer's weights get gradients)."""
    from specdec.training.train import warm_start

    model = LLM(str(target_dir)).engine.model
    old = Eagle3Head.create("eagle3", model, draft_ids=torch.arange(50))
    for p in old.parameters():
        p.data.normal_(0, 0.2)
    new = Eagle3Head.create("eagle3", model, draft_ids=torch.arange(50), num_layers=2)
    warm_start(new, old)
    assert len(new.layers) == 1 and new.config.num_hidden_layers == 2
    ids = torch.tensor([3, 17, 42, 8, 99, 5, 23, 61])
    features, _, _ = target_outputs(model, ids.tolist(), old.aux_layers, logits=False)
    embeds = model.embed_tokens[ids[1:]].float()
    for a, b in zip(old.unroll(embeds, features[:-1], steps=3), new.unroll(embeds, features[:-1], steps=3),
                    strict=True):
        torch.testing.assert_close(a, b)
    for p in new.parameters():
        p.requires_grad_(True)
    new.unroll(embeds.clone(), features[:-1].clone(), steps=2)[-1].square().sum().backward()
    assert new.layers[0].o_proj.weight.grad.abs().sum() > 0


def test_epochs_batches_and_schedule_in_the_log(target_dir, tmp_path):
    """--epochs sets the steps (every conversation once per epoch), --batch accumulates before each optimizer
    step, and the logged learning rate follows the warmup and cosine."""
    from specdec.training.train import lr_factor

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                       {"role": "assistant", "content": f"the answer is {i}"}]})
                              for i in range(5)))
    out = tmp_path / "head"
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--epochs", "2",
                 "--batch", "2", "--warmup", "1", "--lr", "1e-3", "--draft-vocab", "64", "--val-prompts", "1"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 8 and [h["epoch"] for h in log["history"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    lrs = [h["lr"] for h in log["history"][1::2]]  # after each of the 4 optimizer steps
    assert lrs == pytest.approx([1e-3 * lr_factor(u, 4, 1, "cosine") for u in (1, 2, 3, 4)])
    assert all("grad_norm" in h for h in log["history"][1::2])


def test_data_parallel_training_matches_one_process_and_resumes_with_another_world_size(target_dir, tmp_path):
    """2 ranks (torchrun, gloo) against 1 process with the same global batch of 4: the same updates, up to the
    order gradients are summed in. AdamW's first steps divide each gradient by its own magnitude, so a last-bit
    difference in a near-zero gradient moves its weight by a visible part of a step: measured max |difference|
    7.5e-6 after 2 updates at lr 1e-2; asserted 1e-4, 1% of one step. The 2-rank checkpoint then resumes in
    one process and ends where the one-process run resumed the same way ends."""
    rng = random.Random(1)
    words = "the cat sat on a mat and then the dog ran to the park".split()
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(rng.choice(words) for _ in range(5))},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(8))}]}) for _ in range(8)))
    common = ["train", "--target", str(target_dir), "--data", str(data), "--draft-vocab", "64", "--batch", "4",
              "--lr", "1e-2", "--val-prompts", "0", "--save-every", "4"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(common + ["--steps", "8", "--out", str(one)]) == 0
    assert main(common + ["--steps", "8", "--out", str(two), "--nproc", "2"]) == 0
    assert json.loads((two / "train_log.json").read_text())["world_size"] == 2
    cfg = LLM(str(target_dir)).engine.model.config

    def weights(out):
        return Eagle3Head.load(out, cfg).state_dict_reference()

    def max_difference(a, b):
        return max((a[k].float() - b[k].float()).abs().max().item() for k in a)

    a, b = weights(one), weights(two)
    assert a.keys() == b.keys() and torch.equal(a["d2t"], b["d2t"])
    assert max_difference(a, b) <= 1e-4
    for out in (one, two):  # resume both in one process
        assert main(common + ["--steps", "12", "--out", str(out), "--resume"]) == 0
    assert max_difference(weights(one), weights(two)) <= 1e-4 and max_difference(weights(one), a) > 1e-3


def test_data_parallel_ranks_end_their_process_group(target_dir, tmp_path):
    """Each data-parallel rank leaves with its gloo group destroyed, no thread of it left: a group alive at
    interpreter exit aborted a rank now and then (SIGABRT, "terminate called without an active exception"; the
    flaky `pytest tests/test_parallel.py tests/test_train.py`). The group was destroyed, but loading the target's
    tokenizer first imports torch.distributed.nn.functional, whose functions then hold the default group as a
    default argument. The trainer's own ranks, under torchrun, each recording what runs at its exit."""
    import subprocess
    import sys

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                       {"role": "assistant", "content": f"the answer is {i}"}]})
                              for i in range(4)))
    script = tmp_path / "ranks.py"
    script.write_text(gloo_threads_at_exit(tmp_path) +
                      "import sys\nfrom specdec.cli import main\nraise SystemExit(main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), "train", "--target", str(target_dir), "--data", str(data), "--out",
                           str(tmp_path / "head"), "--steps", "4", "--batch", "2", "--draft-vocab", "64",
                           "--val-prompts", "0"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    assert json.loads((tmp_path / "head" / "train_log.json").read_text())["world_size"] == 2
    assert gloo_threads_left(tmp_path) == {"0": [], "1": []}


def test_the_objectives_on_a_hand_checked_row():
    """ce: -sum p log q; topk: the same over p's top k renormalized; acceptance: -log sum min(p, q) + ce / 10."""
    from specdec.training.losses import distribution_term

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    target_logits, logits = p.clamp_min(1e-30).log(), q.log()
    ce = -(p * q.log()).sum().item()
    assert distribution_term(logits, target_logits, "ce").item() == pytest.approx(ce, rel=1e-5)
    top2 = -(0.5 / 0.8 * q[0, 0].log() + 0.3 / 0.8 * q[0, 1].log()).item()
    assert distribution_term(logits, target_logits, "topk", topk=2).item() == pytest.approx(top2, rel=1e-5)
    accepted = 0.25 + 0.25 + 0.2 + 0.0  # sum min(p, q): the chance a draft sampled from q is accepted
    assert distribution_term(logits, target_logits, "acceptance").item() == pytest.approx(
        -torch.tensor(accepted).log().item() + 0.1 * ce, rel=1e-5)
    assert distribution_term(target_logits, target_logits, "acceptance").item() == pytest.approx(
        0.1 * -(p[:, :3] * p[:, :3].log()).sum().item(), abs=1e-5)  # q = p: every draft accepted
    with pytest.raises(Exception, match="unknown objective"):
        distribution_term(logits, target_logits, "kl")


def test_replay_weighs_the_rows_the_heads_own_draft_gets_wrong():
    """Two rows: the head's top-1 is the target's on the first (kept) and not on the second (rejected): replay is
    ce with the second row counted REPLAY_WEIGHT times, (ce1 + w ce2) / (1 + w)."""
    from specdec.training.losses import REPLAY_WEIGHT, distribution_term

    p = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.7, 0.1]])
    target_logits, logits = p.log(), q.log()
    ce = -(p * q.log()).sum(-1)
    want = (ce[0] + REPLAY_WEIGHT * ce[1]) / (1 + REPLAY_WEIGHT)
    assert distribution_term(logits, target_logits, "replay").item() == pytest.approx(want.item(), rel=1e-5)
    assert distribution_term(target_logits, target_logits, "replay").item() == pytest.approx(
        distribution_term(target_logits, target_logits, "ce").item(), rel=1e-6)  # no row rejected: plain ce


@pytest.mark.parametrize("objective", ["ce", "topk", "acceptance", "replay"])
def test_training_on_answers_draws_the_curve_keeps_the_best_head_and_resumes_after_its_time(
        target_dir, tmp_path, objective):
    """`specdec train --distilled DIR`: answers held out by their prompt (never trained on), a point of the curve
    every --eval-every updates whose step-1 top-1 is the share of held-out rows where the head's greedy draft is
    the target's own greedy token, the best head kept in out/best (loadable, in the shipped two-shard layout),
    and --train-seconds stopping with a checkpoint that --resume goes on from."""
    from test_distill import write_data

    from specdec.training import distill

    llm = LLM(str(target_dir), speculative_config="off")
    data = write_data(tmp_path / "data", rows_per_file=10)
    answers = tmp_path / "answers"
    distill.regenerate(llm, data, answers, per_source=None, sampled_share=0.0, max_tokens=24)
    out = tmp_path / "head"
    args = ["train", "--target", str(target_dir), "--data", str(data), "--distilled", str(answers), "--out", str(out),
            "--held-out", "4", "--batch", "2", "--eval-every", "2", "--steps", "12", "--draft-vocab", "64",
            "--objective", objective, "--lr", "1e-2", "--autocast", "off", "--save-every", "4"]
    assert main(args + ["--train-seconds", "1e-9"]) == 0  # out of time before the first update
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 0 and len(log["curve"]) == 1
    assert main(args + ["--resume"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    curve = log["curve"]
    assert log["steps"] == 12 and [c["step"] for c in curve] == [0, 4, 8, 12]
    tokens = [c["answer_tokens"] for c in curve]
    assert tokens == sorted(tokens) and tokens[-1] > 0
    for point in curve:
        for step in ("step1", "step2", "step3"):
            assert 0 <= point[step]["top1"] <= point[step]["top2"] <= point[step]["top4"] <= 1
        assert point["step1"]["rows"] >= point["step2"]["rows"] > 0
    assert log["best"]["step1"]["top1"] == max(c["step1"]["top1"] for c in curve)
    best = Eagle3Head.load(out / "best", llm.engine.model.config)
    assert sorted(p.name for p in (out / "best").glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                          "model-00002-of-00002.safetensors"]
    assert best.draft_vocab_size == 64


def test_skip_and_max_conversations_split_the_corpus_into_passes_that_follow_one_another(target_dir, tmp_path,
                                                                                          capsys):
    """--max-conversations N, then --skip-conversations N (the same seed's order), take the two halves of what one
    pass over 2N takes; a skip past the corpus, or a negative count, is refused by name."""
    from specdec.config import SpecdecError
    from specdec.training.config import TrainConfig
    from specdec.training.train import window

    order = list(range(10))  # the shuffled conversations
    take = lambda skip, most: window(order, skip, most)  # noqa: E731
    assert take(0, 3) == [0, 1, 2] and take(3, 3) == [3, 4, 5] and take(0, 6) == take(0, 3) + take(3, 3)
    assert take(3, 0) == list(range(3, 10)) and take(0, 0) == order
    with pytest.raises(SpecdecError, match="must be >= 0"):
        TrainConfig(out="o", data=["d.jsonl"], skip_conversations=-1)
    bad = tmp_path / "one.jsonl"  # through the command line, before any training
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello there"}]}) + "\n")
    assert main(["train", "--target", str(target_dir), "--data", str(bad), "--out", str(tmp_path / "o"),
                 "--val-prompts", "0", "--skip-conversations", "5"]) == 2
    assert "--skip-conversations 5 leaves none of the 1 training conversations" in capsys.readouterr().err


def test_the_curves_first_position_is_the_heads_greedy_agreement_with_the_target(target_dir, tmp_path):
    """With a draft vocabulary of the whole target vocabulary, the curve's step-1 top-1 equals the loss's own
    count of rows where the head's argmax is the target's argmax (two computations of one figure)."""
    from specdec.training.curve import curve_point, held_out_outputs
    from specdec.training.losses import LossOptions, sequence_loss

    model = LLM(str(target_dir)).engine.model
    V = model.config.vocab_size
    head = Eagle3Head.create("eagle3", model, draft_ids=torch.arange(V))
    rng = random.Random(1)
    held = []
    for _ in range(3):
        ids = [rng.randrange(V) for _ in range(20)]
        held.append((ids, [i >= 6 for i in range(20)]))
    outputs = held_out_outputs(model, head, held)
    point = curve_point(head, model, held, outputs, 1, torch.autocast("cpu", enabled=False))
    hits = rows = 0
    options = LossOptions(ttt_steps=1, ce_weight=1.0, regression_weight=0.1)
    for ids, mask in held:
        with torch.no_grad():
            _, stats = sequence_loss(head, model, ids, mask, options)
        hits, rows = hits + stats["top1"] * stats["n"], rows + stats["n"]
    assert point["step1"]["rows"] == rows and point["step1"]["top1"] == pytest.approx(hits / rows, abs=1e-4)


def test_a_head_fine_tunes_on_recorded_traffic(target_dir, tmp_path):
    """`specdec train --from-traffic DIR`: the target's outputs a server recorded are the training data (a fifth
    of the records, at most --held-out, held out for the curve), starting from --init; traffic of another target
    is not used, and mixing it with --data is refused."""
    from specdec.models.loader import model_fingerprint
    from specdec.serving.traffic import TrafficRecorder

    llm = LLM(str(target_dir), speculative_config="off")
    rng = random.Random(3)
    words = "the cat sat on a mat and then the dog ran to the park".split()
    prompts = [llm.apply_chat_template([{"role": "user", "content": " ".join(rng.choice(words) for _ in range(5))}])
               for _ in range(20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16))
    traffic = tmp_path / "traffic"
    recorder = TrafficRecorder(traffic, model_fingerprint(llm.engine.model))
    for p, o in zip(prompts, outs):
        recorder.record(p, o.token_ids, o.finish_reason, 0.0)
    TrafficRecorder(traffic, "another-target").record([1, 2, 3], [4, 5, 6], "stop", 0.0)
    recorder.close()
    init = tmp_path / "init"
    head = Eagle3Head.create("eagle3", llm.engine.model, draft_ids=torch.arange(64))
    head.save(init)
    out = tmp_path / "tuned"
    args = ["train", "--target", str(target_dir), "--from-traffic", str(traffic), "--out", str(out), "--init",
            str(init), "--steps", "16", "--batch", "4", "--eval-every", "2", "--lr", "1e-2", "--autocast", "off"]
    assert main(args) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 16 and log["curve"][0]["step1"]["rows"] > 0 and len(log["curve"]) == 3
    assert Eagle3Head.load(out / "best", llm.engine.model.config).draft_vocab_size == 64  # --init's vocabulary
    assert main(args + ["--data", str(traffic)]) == 2
    empty = tmp_path / "empty"
    TrafficRecorder(empty, "another-target").record([1, 2, 3], [4, 5, 6], "stop", 0.0)
    assert main(["train", "--target", str(target_dir), "--from-traffic", str(empty), "--out", str(out),
                 "--init", str(init)]) == 2


def test_a_library_caller_trains_from_a_config_without_the_command_line(target_dir, tmp_path):
    """`run_train(TrainConfig(...))` is the whole trainer, no argparse: it fills in what the method decides
    (ttt_steps) and the data decides (steps, from epochs) in a config of its own, logged, and leaves the caller's
    as given."""
    from specdec.training.config import TrainConfig
    from specdec.training.train import run_train

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                       {"role": "assistant", "content": f"the answer is {i}"}]})
                              for i in range(3)))
    cfg = TrainConfig(target=str(target_dir), data=[str(data)], out=str(tmp_path / "head"), epochs=1,
                      draft_vocab=64, val_prompts=0)
    result = run_train(cfg)
    assert result["steps"] == 3 and result["config"]["steps"] == 3 and result["config"]["ttt_steps"] == 3
    assert cfg.steps == 1000 and cfg.ttt_steps is None  # the caller's config, untouched
    assert json.loads((tmp_path / "head" / "train_log.json").read_text())["config"] == result["config"]
    assert Eagle3Head.load(tmp_path / "head", LLM(str(target_dir)).engine.model.config).draft_vocab_size == 64


@pytest.mark.parametrize(("flags", "fields", "message"), [
    (["--epochs", "0"], {"epochs": 0.0}, "invalid --epochs 0.0: must be > 0"),
    (["--batch", "0"], {"batch": 0}, "invalid --batch 0: must be >= 1"),
    (["--max-len", "-1"], {"max_len": -1}, "invalid --max-len -1: must be >= 1"),
    (["--method", "eagle", "--ttt-steps", "2"], {"method": "eagle", "ttt_steps": 2},
     "--ttt-steps is EAGLE-3's training-time test; eagle trains one step"),
    (["--max-conversations", "-2"], {"max_conversations": -2},
     "invalid --skip-conversations 0 / --max-conversations -2: must be >= 0"),
    (["--autocast", "fp8"], {"autocast": "fp8"}, "invalid --autocast 'fp8': one of auto, bf16, off"),
    (["--method", "lookahead"], {"method": "lookahead"}, "the trainer supports ['eagle', 'eagle3', 'medusa', 'mtp']"),
])
def test_a_bad_config_is_refused_with_the_command_lines_message(tmp_path, capsys, flags, fields, message):
    """The config checks itself when made, so the command line and a library caller read the same error, before
    any model is loaded."""
    from specdec.config import SpecdecError
    from specdec.training.config import TrainConfig

    with pytest.raises(SpecdecError) as refused:
        TrainConfig(out=str(tmp_path / "o"), data=["missing.jsonl"], **fields)
    assert message in str(refused.value)
    assert main(["train", "--data", "missing.jsonl", "--out", str(tmp_path / "o"), *flags]) == 2
    assert f"specdec: error: {refused.value}" in capsys.readouterr().err
    with pytest.raises(SpecdecError, match="what to train on"):
        TrainConfig(out="o")


def test_every_train_flag_is_a_config_field_with_the_same_default():
    """The command line's `train` flags and `TrainConfig` agree: no flag is dropped on the way (but the launcher's
    --nproc), and a library caller gets the command line's defaults."""
    from specdec.cli import build_parser
    from specdec.training.config import TrainConfig

    flags = vars(build_parser().parse_args(["train", "--out", "o"]))
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert {k: v for k, v in flags.items() if k not in ("command", "nproc")} == {**fields, "out": "o"}
