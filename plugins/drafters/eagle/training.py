"""``infer train-eagle CONFIG --out DIR``: train the EAGLE draft head for CONFIG's model by self-distillation.

1. Generate: infer's own engine answers a prompt set (built-in or JSONL) with the target, greedily and at large
   batch, while a recorder in the drafter's seat keeps the target's final hidden state of every token it computes.
2. Train: the head learns the target's next feature (smooth-L1) and next-token distribution (cross-entropy over a
   draft vocabulary: the most frequent answer tokens), unrolled a few steps on its own predicted features as in drafting
   (each unrolled step attends to the true-feature KV before the chain and its own KV along it), with noise on the
   target features.
3. Stop early on held-out acceptance (tokens per verify pass at k drafts, bonus token included, measured on answers
   the head never trained on), write ``head.safetensors`` and a README card to DIR.

Part of the ``eagle`` drafter plugin, which registers the command through ``register_commands``.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from infer.drafter import Drafter
from infer.plugins.drafters.eagle import head as head_api
from infer.plugins.drafters.eagle.options import TrainEagleOptions

TOPICS = [
    "volcanoes",
    "the stock market",
    "photosynthesis",
    "chess openings",
    "the French Revolution",
    "black holes",
    "machine learning",
    "gardening tomatoes",
    "climate change",
    "the human heart",
    "ancient Rome",
    "jazz music",
    "electric cars",
    "coffee brewing",
    "the immune system",
    "plate tectonics",
    "cryptocurrency",
    "honeybees",
    "the printing press",
    "renewable energy",
    "sleep",
    "the Great Wall of China",
    "quantum computing",
    "recycling",
    "marathon training",
    "the moon landing",
    "vaccines",
    "deep sea creatures",
    "the internet",
    "bread baking",
    "meditation",
    "dinosaurs",
    "solar panels",
    "the water cycle",
    "learning a new language",
    "public speaking",
    "time management",
    "the Renaissance",
    "rainforests",
    "3D printing",
    "the Olympic Games",
    "antibiotics",
    "video game design",
    "the Roman alphabet",
    "earthquakes",
    "nutrition",
    "origami",
    "the theory of evolution",
    "submarines",
    "democracy",
    "the periodic table",
    "wind turbines",
    "sharks",
    "budgeting",
    "the Silk Road",
    "hurricanes",
    "photography",
    "the Pyramids of Giza",
    "artificial satellites",
    "composting",
    "poetry",
    "the speed of light",
    "friendship",
    "job interviews",
    "cloud computing",
    "penguins",
    "the Industrial Revolution",
    "yoga",
    "glaciers",
    "chocolate",
    "the Moon",
    "bicycles",
    "Shakespeare",
    "vitamins",
    "the Amazon river",
    "password security",
    "cats",
    "dogs",
    "trains",
    "mountains",
    "the ocean tides",
    "electricity",
    "magnets",
    "the Vikings",
    "birds migrating",
    "smartphones",
    "the solar system",
    "tea",
    "rivers",
    "deserts",
    "robots",
    "writing a resume",
    "running a small business",
    "saving money",
    "cooking pasta",
    "camping",
    "paper",
    "the alphabet",
    "museums",
    "libraries",
    "trees",
    "snow",
    "fire safety",
    "bridges",
    "airplanes",
    "opera",
    "statistics",
    "probability",
    "the Python programming language",
    "sorting algorithms",
    "databases",
    "encryption",
    "operating systems",
    "compilers",
    "the history of mathematics",
    "prime numbers",
    "geometry",
]
TASKS = [
    "Explain {topic} to a beginner.",
    "Write a short story about {topic}.",
    "Give me three interesting facts about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a short poem about {topic}.",
    "Describe the history of {topic} in a few sentences.",
    "How does {topic} work?",
    "Write a friendly email to a colleague about {topic}.",
    "What is a common misconception about {topic}?",
    "List five questions a student might ask about {topic}, with short answers.",
    "Summarize what everyone should know about {topic}.",
    "Write a dialogue between two friends about {topic}.",
    "Give me a step-by-step guide related to {topic}.",
    "Why is {topic} important?",
    "Write a product description inspired by {topic}.",
    "Explain {topic} as if I were ten years old.",
]
# Everyday requests, phrased the way people ask a chat assistant for help.
EVERYDAY_TOPICS = [
    "houseplants",
    "a first apartment",
    "a long flight",
    "a job offer",
    "a leaky faucet",
    "a noisy neighbor",
    "a school science project",
    "a road trip",
    "a wedding toast",
    "a picky eater",
    "a rainy weekend",
    "a new puppy",
    "a slow laptop",
    "a tight budget",
    "a morning routine",
    "a first date",
    "a group project",
    "a garden in spring",
    "a sore back",
    "a language exam",
    "a birthday party",
    "a house move",
    "an online course",
    "a vegetable soup",
    "a bike repair",
    "a winter coat",
    "a family reunion",
    "a marathon",
    "a study schedule",
    "a small balcony",
    "a cover letter",
    "a team meeting",
    "a cold",
    "a sourdough starter",
    "an aquarium",
    "a camping trip",
]
EVERYDAY_TASKS = [
    "How do I get started with {topic}?",
    "What should I think about when dealing with {topic}?",
    "Can you give me some practical tips for {topic}?",
    "What are common mistakes people make with {topic}?",
    "I'm worried about {topic}. What can I do?",
    "Help me plan {topic}.",
    "What do I need for {topic}?",
    "Could you suggest a checklist for {topic}?",
]


@dataclass(slots=True)
class Example:
    """One prompt and its answer: tokens ``[n]``, the target's features at positions ``0 .. n-2`` (the last token is
    never fed to the target), and where the answer starts."""

    token_ids: torch.Tensor
    features: torch.Tensor
    num_prompt_tokens: int


@dataclass(slots=True)
class TrainReport:
    target: str
    num_self_prompts: int = 0
    num_train_examples: int = 0
    num_held_out_examples: int = 0
    num_train_tokens: int = 0
    num_answer_tokens: int = 0
    draft_vocab_size: int = 0
    draft_vocab_coverage: float = 0.0
    steps: int = 0
    best_step: int = 0
    held_out_acceptance: float = 0.0
    acceptance_curve: list[tuple[int, float]] = field(default_factory=list)
    generation_s: float = 0.0
    training_s: float = 0.0


def builtin_prompts(count: int, seed: int) -> list[list[dict]]:
    """``count`` chat prompts from every task applied to every topic, in a seeded order."""
    texts = [task.format(topic=topic) for topic in TOPICS for task in TASKS]
    texts += [task.format(topic=topic) for topic in EVERYDAY_TOPICS for task in EVERYDAY_TASKS]
    random.Random(seed).shuffle(texts)
    return [[{"role": "user", "content": text}] for text in texts[:count]]


def self_written_prompts(llm, count: int, seed: int, max_tokens: int = 64) -> list[list[dict]]:
    """Up to ``count`` user requests written by the target itself (Magpie, Xu et al. 2024): its chat template up to
    where a user's message begins, continued by sampling at temperature 1, each from its own seed, so the requests are
    the kind the model was tuned to answer, in phrasings and on topics nobody listed. A request is kept when the model
    ended the turn itself within ``max_tokens`` tokens; duplicates are dropped."""
    from infer.sampling_params import SamplingParams

    if count <= 0:
        return []
    marker = "\x00REQUEST\x00"
    template = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    prefix = llm.engine.tokenizer.encode(template[: template.index(marker)], add_special_tokens=False)
    # A fifth more samples than asked for: some run past max_tokens and some repeat.
    samples = count + count // 5 + 1
    params = [
        SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed * 1_000_003 + index)
        for index in range(samples)
    ]
    texts = {}
    for output in llm.generate([prefix] * samples, params, use_tqdm=True):
        text = output.text.strip()
        if output.error is None and output.finish_reason == "stop" and len(output.token_ids) >= 4 and text:
            texts.setdefault(text, None)
    return [[{"role": "user", "content": text}] for text in list(texts)[:count]]


# -- 1. generating the data -----------------------------------------------------------------------------------------
class FeatureRecorder(Drafter):
    """Sits in the engine's drafter seat: proposes nothing, keeps every computed token's final hidden state.

    Each sequence's features go into one buffer sized for its longest possible length, allocated when it first
    runs: thousands of per-step row tensors kept alive between the engine's large transient allocations fragmented
    the heap (RSS grew by ~80 KB per generated token for 1.2 KB of features)."""

    needs_hidden_states = True

    def __init__(self):
        super().__init__()
        self.features: dict[str, torch.Tensor] = {}
        self.lengths: dict[str, int] = {}

    def observe(self, output) -> None:
        for row in output.token_rows:
            seq = row.seq
            buffer = self.features.get(seq.seq_id)
            if buffer is None:
                # bfloat16 halves the memory of a large run; the features are inputs and targets, not weights.
                buffer = torch.empty(
                    seq.num_prompt_tokens + seq.params.max_tokens, output.hidden_states.shape[1], dtype=torch.bfloat16
                )
                self.features[seq.seq_id] = buffer
            end = row.first_position + row.count
            # A preempted sequence recomputes from an earlier position and overwrites what follows it.
            buffer[row.first_position : end] = output.hidden_states[row.start : row.start + row.count]
            self.lengths[seq.seq_id] = end

    def take(self, seq_id: str, length: int) -> torch.Tensor:
        """The first ``length`` features of a finished sequence (its buffer is released)."""
        recorded = self.lengths.pop(seq_id)
        return self.features.pop(seq_id)[: min(length, recorded)].clone()

    def propose(self, sequences, k):
        return [[] for _ in sequences]


def generate_examples(llm, prompts: list, options: TrainEagleOptions) -> list[Example]:
    """Greedy answers from the target with every token's feature."""
    from infer.sampling_params import SamplingParams

    recorder = FeatureRecorder()
    llm.engine.speculation.drafter = recorder
    params = SamplingParams(max_tokens=options.max_tokens, temperature=0.0)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    examples = []
    for output in outputs:
        if output.error is not None:
            continue
        token_ids = output.prompt_token_ids + output.token_ids
        features = recorder.take(f"{output.request_id}/0", len(token_ids) - 1)
        examples.append(Example(torch.tensor(token_ids), features, len(output.prompt_token_ids)))
    return examples


def cached_examples(path: Path | None, generate) -> tuple[list[Example], float, int]:
    """The examples saved at ``path`` when it exists; otherwise ``generate()``'s (examples and how many prompts the
    target wrote), saved there when a path is given (a second training run on the same data skips generation). Also
    returns the seconds generation took and the number of self-written prompts."""
    if path is not None and path.is_file():
        saved = torch.load(path)
        return (
            [Example(**fields) for fields in saved["examples"]],
            saved["generation_s"],
            saved.get("num_self_prompts", 0),
        )
    start = time.monotonic()
    examples, num_self_prompts = generate()
    seconds = time.monotonic() - start
    if path is not None:
        fields = [
            {"token_ids": e.token_ids, "features": e.features, "num_prompt_tokens": e.num_prompt_tokens}
            for e in examples
        ]
        torch.save({"examples": fields, "generation_s": seconds, "num_self_prompts": num_self_prompts}, path)
    return examples, seconds, num_self_prompts


def draft_vocabulary(examples: list[Example], size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent answer tokens (sorted ids), and the share of answer tokens they cover."""
    answers = torch.cat([example.token_ids[example.num_prompt_tokens :] for example in examples])
    counts = torch.bincount(answers)
    size = min(size, int((counts > 0).sum()))
    top = torch.topk(counts, size).indices
    return top.sort().values, float(counts[top].sum() / counts.sum())


# -- 2. batches and the unrolled head -------------------------------------------------------------------------------
@dataclass(slots=True)
class Batch:
    """Examples padded to one length L (pair position t reads feature f_t and token x_{t+1})."""

    next_tokens: torch.Tensor  # [B, L] x_{t+1}
    features: torch.Tensor  # [B, L, hidden] f_t
    target_features: torch.Tensor  # [B, L, hidden] f_{t+1}
    labels: torch.Tensor  # [B, L] draft-vocabulary index of answer token x_{t+2}; -2: not in it; -1: no answer
    has_target: torch.Tensor  # [B, L] bool: f_{t+1} exists
    is_real: torch.Tensor  # [B, L] bool: not padding


def make_batch(examples: list[Example], vocab_index: torch.Tensor) -> Batch:
    length = max(example.features.shape[0] for example in examples)
    size, hidden = len(examples), examples[0].features.shape[1]
    batch = Batch(
        torch.zeros(size, length, dtype=torch.int64),
        torch.zeros(size, length, hidden),
        torch.zeros(size, length, hidden),
        torch.full((size, length), -1, dtype=torch.int64),
        torch.zeros(size, length, dtype=torch.bool),
        torch.zeros(size, length, dtype=torch.bool),
    )
    for row, example in enumerate(examples):
        num_pairs = example.features.shape[0]  # positions 0 .. n-2
        batch.next_tokens[row, :num_pairs] = example.token_ids[1:]
        batch.features[row, :num_pairs] = example.features
        batch.target_features[row, : num_pairs - 1] = example.features[1:]
        batch.has_target[row, : num_pairs - 1] = True
        batch.is_real[row, :num_pairs] = True
        labels = vocab_index[example.token_ids[2:]]
        labels[labels < 0] = -2
        labels[: max(example.num_prompt_tokens - 2, 0)] = -1
        batch.labels[row, : num_pairs - 1] = labels
    return batch


def batches(
    examples: list[Example], tokens_per_batch: int, vocab_index: torch.Tensor, shuffle: random.Random | None
) -> list[Batch]:
    """Examples grouped by length (little padding) into batches of about ``tokens_per_batch`` padded tokens."""
    ordered = sorted(examples, key=lambda example: example.features.shape[0])
    groups, group = [], []
    for example in ordered:
        if group and (len(group) + 1) * example.features.shape[0] > tokens_per_batch:
            groups.append(group)
            group = []
        group.append(example)
    groups.append(group)
    if shuffle is not None:
        shuffle.shuffle(groups)
    return [make_batch(group, vocab_index) for group in groups]


def unrolled_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], is_real: torch.Tensor
) -> torch.Tensor:
    """Attention of unrolled step s = len(keys) - 1, as drafting sees it: the query at position t reads the
    true-feature KV of step 0 at positions <= t - s, and the KV of step j at position t - (s - j) along the chain.

    ``q`` [B, L, heads, d]; ``keys``/``values`` [B, L, kv_heads, d] per step; returns [B, L, heads, d].
    """
    steps = len(keys) - 1
    length, heads, dim = q.shape[1:]
    group = heads // keys[0].shape[2]
    scale = dim**-0.5
    query = q.transpose(1, 2)  # [B, heads, L, d]
    spread = [k.repeat_interleave(group, dim=2).transpose(1, 2) for k in keys]
    spread_values = [v.repeat_interleave(group, dim=2).transpose(1, 2) for v in values]
    positions = torch.arange(length)
    sees_true = (positions[None, :] <= positions[:, None] - steps) & is_real[:, None, None, :]
    scores = [(query @ spread[0].transpose(-1, -2) * scale).masked_fill(~sees_true, float("-inf"))]
    chain_values = []
    for j in range(1, steps + 1):
        offset = steps - j
        key = F.pad(spread[j], (0, 0, offset, 0))[:, :, :length]
        chain_values.append(F.pad(spread_values[j], (0, 0, offset, 0))[:, :, :length])
        score = (query * key).sum(-1, keepdim=True) * scale
        scores.append(score.masked_fill(positions[:, None] < offset, float("-inf")))
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = weights[..., :length] @ spread_values[0]
    for j, value in enumerate(chain_values):
        out = out + weights[..., length + j, None] * value
    return out.transpose(1, 2)


def unrolled_forward(head, target, batch: Batch, steps: int, noise: float) -> list[torch.Tensor]:
    """The head's predicted features ``[B, L, hidden]`` at each unrolled step; step s > 0 reads the features that
    step s - 1 predicted for its position."""
    layer, attention = head.layer, head.layer.self_attn
    size, length = batch.next_tokens.shape
    with torch.no_grad():
        embeds = target.embed(batch.next_tokens).float()
    cos, sin = target.rotary(torch.arange(length), torch.float32)
    features = batch.features + noise * torch.randn_like(batch.features) if noise else batch.features
    keys, values, outputs = [], [], []
    for _ in range(steps):
        x = head.combine(embeds, features)
        q, k, v = attention.qkv_proj(layer.input_layernorm(x)).split(
            [attention.q_size, attention.kv_size, attention.kv_size], dim=-1
        )
        q = apply_rotary(q.view(size, length, attention.num_heads, attention.head_dim), cos, sin)
        keys.append(apply_rotary(k.view(size, length, attention.num_kv_heads, attention.head_dim), cos, sin))
        values.append(v.view(size, length, attention.num_kv_heads, attention.head_dim))
        mixed = unrolled_attention(q, keys, values, batch.is_real)
        x = x + attention.o_proj(mixed.reshape(size, length, attention.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        outputs.append(head.norm(x))
        features = F.pad(outputs[-1], (0, 0, 1, 0))[:, :length]
    return outputs


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from infer.model import apply_rotary as rotate

    return rotate(x, cos[None], sin[None])


def unrolled_loss(
    outputs: list[torch.Tensor], batch: Batch, head_weight: torch.Tensor, feature_scale: float, ce_weight: float
) -> torch.Tensor:
    """Feature regression plus cross-entropy against the target's own next-token distribution over the draft
    vocabulary (richer than its argmax alone), each unrolled step weighted 0.8 times the one before."""
    with torch.no_grad():
        teacher = torch.softmax(batch.target_features @ head_weight.T, dim=-1)  # [B, L, draft vocab]
    total = torch.zeros(())
    length = batch.labels.shape[1]
    for step, predicted in enumerate(outputs):
        # The chain of step s starts s positions earlier, so its first s positions have no chain.
        has_target = batch.has_target & (torch.arange(length) >= step)
        regression = F.smooth_l1_loss(
            predicted[has_target] / feature_scale, batch.target_features[has_target] / feature_scale
        )
        log_q = torch.log_softmax(predicted[has_target] @ head_weight.T, dim=-1)
        cross_entropy = -(teacher[has_target] * log_q).sum(-1).mean()
        total = total + 0.8**step * (regression + ce_weight * cross_entropy)
    return total


@torch.no_grad()
def acceptance(head, target, batches_: list[Batch], head_weight: torch.Tensor, num_drafts: int) -> float:
    """Tokens per verify pass (bonus included) of greedy chain drafting with ``num_drafts`` guesses on the held-out
    answers, replaying the engine: a pass at pair position a commits 1 + the number of leading guesses equal to the
    target's tokens, and the next pass starts right after them (easy stretches take few passes)."""
    head.eval()
    tokens, passes = 0, 0
    for batch in batches_:
        outputs = unrolled_forward(head, target, batch, num_drafts, noise=0.0)
        length = batch.labels.shape[1]
        run = torch.ones_like(batch.labels, dtype=torch.bool)
        accepted = torch.zeros(batch.labels.shape, dtype=torch.int64)
        for step, predicted in enumerate(outputs):
            correct = (predicted @ head_weight.T).argmax(-1) == batch.labels
            # The chain that starts at position a makes its guess number s + 1 at position a + s.
            run = run & F.pad(correct, (0, step), value=False)[:, step : step + length]
            accepted += run
        for labels, row in zip(batch.labels.tolist(), accepted.tolist()):
            position = next((t for t, label in enumerate(labels) if label != -1), length)
            while position < length and labels[position] != -1:
                tokens += 1 + row[position]
                passes += 1
                position += 1 + row[position]
    head.train()
    return tokens / max(passes, 1)


# -- 3. the training loop -------------------------------------------------------------------------------------------
def train_head(
    head,
    target,
    train_set: list[Example],
    held_out: list[Example],
    vocab_index: torch.Tensor,
    head_weight: torch.Tensor,
    options: TrainEagleOptions,
    report: TrainReport,
) -> dict:
    """AdamW with a cosine schedule; returns the weights with the best held-out acceptance."""
    from tqdm import tqdm

    shuffle = random.Random(options.seed)
    feature_scale = float(torch.cat([example.features for example in train_set[:64]]).float().std())
    held_out_batches = batches(held_out, options.tokens_per_batch, vocab_index, None)
    num_batches = len(batches(train_set, options.tokens_per_batch, vocab_index, None))
    total_steps = options.epochs * num_batches
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.learning_rate, weight_decay=0.0)
    # The cosine ends where training will: after every epoch, or at the time limit when that comes first (its step
    # estimated from the pace so far, evaluations included), so a run cut by the clock still anneals.
    horizon = [total_steps]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(step / horizon[0], 1.0)))
    )
    best = _evaluate(head, target, held_out_batches, head_weight, options, report, 0, None)
    started = time.monotonic()
    deadline = started + options.max_minutes * 60
    progress = tqdm(total=total_steps, desc="training", unit="step", dynamic_ncols=True)
    stale = 0
    for batch in _epochs(train_set, vocab_index, options, shuffle):
        outputs = unrolled_forward(head, target, batch, options.unroll_steps, options.feature_noise * feature_scale)
        loss = unrolled_loss(outputs, batch, head_weight, feature_scale, options.ce_weight)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        report.steps += 1
        progress.update(1)
        progress.set_postfix(loss=f"{loss.item():.3f}", accept=f"{report.held_out_acceptance:.2f}", refresh=False)
        if report.steps == options.eval_every + 1:  # the pace includes one evaluation
            pace = report.steps / (time.monotonic() - started)
            horizon[0] = max(report.steps + 1, min(total_steps, int(pace * options.max_minutes * 60)))
        if report.steps % options.eval_every == 0:
            improved = _evaluate(head, target, held_out_batches, head_weight, options, report, report.steps, best)
            stale = 0 if improved is not best else stale + 1
            best = improved
        if stale >= options.patience or time.monotonic() > deadline:
            break
    progress.close()
    best = _evaluate(head, target, held_out_batches, head_weight, options, report, report.steps, best)
    return best["state"]


def _epochs(train_set: list[Example], vocab_index: torch.Tensor, options: TrainEagleOptions, shuffle: random.Random):
    for _ in range(options.epochs):
        yield from batches(train_set, options.tokens_per_batch, vocab_index, shuffle)


def _evaluate(head, target, held_out_batches, head_weight, options, report: TrainReport, step: int, best):
    """Measure held-out acceptance; returns the new best snapshot (``best`` itself when not improved)."""
    score = acceptance(head, target, held_out_batches, head_weight, options.eval_drafts)
    report.acceptance_curve.append((step, round(score, 3)))
    if best is not None and score <= best["score"]:
        return best
    report.best_step, report.held_out_acceptance = step, score
    return {"score": score, "state": {name: value.detach().clone() for name, value in head.state_dict().items()}}


# -- the command ----------------------------------------------------------------------------------------------------
def train_eagle(
    config,
    overrides: list[str],
    out: Path,
    prompts_path: Path | None,
    options: TrainEagleOptions,
    data_path: Path | None = None,
) -> TrainReport:
    """Generate, train, write; returns the report."""
    from infer.llm import LLM
    from infer.prompts import read_jsonl

    torch.manual_seed(options.seed)
    settings = [
        "drafter.name=none",
        "prefix_cache.name=none",
        f"scheduler.max_num_seqs={options.generation_batch}",
        *overrides,
    ]
    llm = LLM(config, dotlist=settings)
    target = llm.engine.model
    report = TrainReport(target=llm.engine.model_name)
    prompts = (
        [item.prompt for item in read_jsonl(prompts_path)]
        if prompts_path
        else builtin_prompts(options.num_prompts, options.seed)
    )

    def generate():
        written = self_written_prompts(llm, options.self_prompts, options.seed)
        mixed = prompts[: options.num_prompts] + written
        random.Random(options.seed).shuffle(mixed)
        return generate_examples(llm, mixed, options), len(written)

    examples, report.generation_s, report.num_self_prompts = cached_examples(data_path, generate)
    train_set, held_out = _split(examples, options)
    vocab_ids, report.draft_vocab_coverage = draft_vocabulary(train_set, options.draft_vocab_size)
    report.draft_vocab_size = len(vocab_ids)
    vocab_index = torch.full((target.vocab_size,), -1, dtype=torch.int64)
    vocab_index[vocab_ids] = torch.arange(len(vocab_ids))
    _count(report, train_set, held_out)
    head = head_api.EagleHead(target.config, vocab_ids, torch.float32, "cpu")
    head_api.initialize(head, target)
    head_weight = head_api.draft_head_weight(target, vocab_ids).float()
    start = time.monotonic()
    head.load_state_dict(train_head(head, target, train_set, held_out, vocab_index, head_weight, options, report))
    report.training_s = time.monotonic() - start
    out.mkdir(parents=True, exist_ok=True)
    head_api.save_head(head, out / "head.safetensors", report.target, asdict(report))
    (out / "README.md").write_text(model_card(report, options, config, overrides, prompts_path))
    return report


def _split(examples: list[Example], options: TrainEagleOptions) -> tuple[list[Example], list[Example]]:
    """Held-out answers come from prompts the head never trains on."""
    order = list(range(len(examples)))
    random.Random(options.seed).shuffle(order)
    num_held_out = max(1, int(len(examples) * options.held_out_fraction))
    return [examples[i] for i in order[num_held_out:]], [examples[i] for i in order[:num_held_out]]


def _count(report: TrainReport, train_set: list[Example], held_out: list[Example]) -> None:
    report.num_train_examples, report.num_held_out_examples = len(train_set), len(held_out)
    report.num_train_tokens = sum(int(example.token_ids.shape[0]) for example in train_set)
    report.num_answer_tokens = sum(int(example.token_ids.shape[0]) - example.num_prompt_tokens for example in train_set)


def model_card(report: TrainReport, options: TrainEagleOptions, config, overrides, prompts_path) -> str:
    """The README next to the head: data, training, measured acceptance, and how to reproduce it."""
    source = (
        str(prompts_path)
        if prompts_path
        else (
            f"the built-in set ({len(TOPICS)} topics x {len(TASKS)} tasks, "
            f"{len(EVERYDAY_TOPICS)} x {len(EVERYDAY_TASKS)} everyday)"
        )
    )
    self_written = (
        f" and {report.num_self_prompts} requests the target wrote itself (sampled from its chat "
        f"template where a user's turn begins)"
        if report.num_self_prompts
        else ""
    )
    command = " ".join(
        [
            "infer train-eagle",
            str(config),
            *overrides,
            "--out DIR",
            *_option_flags(options),
            *([f"--prompts {prompts_path}"] if prompts_path else []),
        ]
    )
    return "\n".join(
        [
            f"# EAGLE draft head for {report.target}",
            "",
            "One decoder layer over `fc(concat(norm(embed(next token)), norm(target feature)))`, trained by",
            "self-distillation with `infer train-eagle`; used by `drafter: eagle` (`configs/radix_lpm_eagle.yaml`).",
            "",
            (
                f"- Data: {report.num_train_examples} greedy answers of the target (max {options.max_tokens} tokens) "
                f"to prompts from {source}{self_written}; {report.num_train_tokens} tokens "
                f"({report.num_answer_tokens} in answers), generated by infer's engine in "
                f"{report.generation_s / 60:.1f} min."
            ),
            (
                f"- Draft vocabulary: the {report.draft_vocab_size} most frequent answer tokens, covering "
                f"{report.draft_vocab_coverage:.1%} of answer tokens."
            ),
            (
                f"- Training: {report.steps} steps ({report.training_s / 60:.1f} min on CPU), {options.unroll_steps} "
                f"unrolled steps, feature noise {options.feature_noise}, best at step {report.best_step}."
            ),
            (
                f"- Held-out acceptance ({report.num_held_out_examples} answers to unseen prompts, greedy chain of "
                f"{options.eval_drafts} drafts, replayed as the engine verifies): "
                f"**{report.held_out_acceptance:.2f} tokens per verify pass** (bonus included)."
            ),
            f"- Acceptance during training (step, tokens per pass): {report.acceptance_curve}",
            "",
            "Reproduce:",
            "",
            f"    OMP_NUM_THREADS={torch.get_num_threads()} {command}",
            "",
        ]
    )


def _option_flags(options: TrainEagleOptions) -> list[str]:
    defaults = TrainEagleOptions()
    return [
        f"--{name.replace('_', '-')} {value}"
        for name, value in asdict(options).items()
        if value != getattr(defaults, name)
    ]
