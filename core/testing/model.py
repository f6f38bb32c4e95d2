"""The model plugin suite: a family's tiny random-weight model, built by HF transformers from its config class and
saved, loaded into HF and into infer from the same files; float32 logits compared at every prefill and decode
position, greedy tokens compared exactly, through the whole engine.

A family's whole test file::

    from infer.testing import ModelConformance

    class TestQwen3(ModelConformance):
        impl_name = "qwen3"
        hf_model_class = "Qwen3ForCausalLM"
        config_fields = {"head_dim": 32}

What it covers: prompts longer than the config's sliding window and decoding past it, mixed batches of short and
long requests, chunked prefill, preemption and prefix-cache hits (engine runs against HF ``generate``), each on the
attention backends that run here. Random tiny models have near-uniform logits, where a near tie flips on rounding:
the weights are drawn with a large ``initializer_range`` and the norms' weights are perturbed (HF initializes them
to one value, which would hide a norm applied in the wrong place).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from infer.attention import AttentionMetadata
from infer.testing.suite import ConformanceSuite

# Shared by the tiny configs so SmolLM2's tokenizer (saved beside the weights) serves every family.
VOCAB_SIZE = 49152
TINY_FIELDS: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def random_prompt(length: int, seed: int) -> list[int]:
    """Token ids (away from the special ones) of a prompt of ``length`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(100, 20000, (length,), generator=generator)).tolist()


def save_tiny_model(hf_model_class: str, config: Any, destination: Path, seed: int = 0) -> Path:
    """Build ``transformers.<hf_model_class>(config)`` with seeded random weights (norm weights perturbed), save it
    with SmolLM2's tokenizer as a HF folder, and return the folder."""
    import transformers

    from infer.model.loader import DEFAULT_MODEL, hf_model_dir

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, hf_model_class)(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.add_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(destination)
    transformers.AutoTokenizer.from_pretrained(hf_model_dir(DEFAULT_MODEL)).save_pretrained(destination)
    return destination


def save_in_bf16(model_dir: Path) -> Path:
    """Rewrite every tensor of ``model_dir``'s safetensors files in bf16, in place: the same model as a bf16
    checkpoint (what a published one is)."""
    from safetensors.torch import load_file, save_file

    for path in Path(model_dir).glob("*.safetensors"):
        save_file({name: tensor.bfloat16() for name, tensor in load_file(path).items()}, path)
    return Path(model_dir)


class PagedRunner:
    """A model over a paged pool, one batched call per step: shuffled pool blocks, per-sequence block tables, the
    attention backend ``backend_name`` (``sdpa``, ``cpu``, ...), infer's CPU kernels when ``kernels`` (on the
    execution ``paths`` named, in order; default all)."""

    def __init__(
        self,
        model,
        backend_name: str = "sdpa",
        block_size: int = 4,
        num_blocks: int = 256,
        kernels: bool = False,
        seed: int = 0,
        paths: Sequence[str] | None = None,
    ):
        from infer.execution.paths import PATH_NAMES, Executor
        from infer.kernels import cpu as cpu_kernels
        from infer.registry import get_registry

        self.model = model
        self.block_size = block_size
        self.executor = Executor.for_model(model, cpu_kernels.load(True) if kernels else None, paths or PATH_NAMES)
        backend_class = get_registry().load("attention", backend_name)
        self.backend = backend_class(
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=block_size,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        self.backend.set_layers(model.layer_attention, model.attention_sinks)
        self.kv_cache = self.backend.allocate_kv_cache(model.num_layers, num_blocks)
        generator = torch.Generator().manual_seed(seed)
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, new_tokens: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Compute ``new_tokens`` of each sequence in one batch; each sequence's logits ``[n, vocab]``."""
        names = list(new_tokens)
        for name in names:
            table = self.block_tables.setdefault(name, [])
            needed = math.ceil((self.num_cached.get(name, 0) + len(new_tokens[name])) / self.block_size)
            table.extend(self.free_blocks.pop() for _ in range(needed - len(table)))
        metadata = AttentionMetadata.build(
            [self.block_tables[name] for name in names],
            [self.num_cached.get(name, 0) for name in names],
            [len(new_tokens[name]) for name in names],
            self.block_size,
        )
        input_ids = torch.tensor([token for name in names for token in new_tokens[name]])
        step = self.executor.step(
            self.model.rotary, self.backend.prepare(metadata), self.kv_cache, self.backend, torch.float32
        )
        logits = self.model.compute_logits(self.model(input_ids, step)).split(metadata.query_lens_cpu)
        for name in names:
            self.num_cached[name] = self.num_cached.get(name, 0) + len(new_tokens[name])
        return dict(zip(names, logits))


class ModelConformance(ConformanceSuite):
    """The suite for a model family (plugin kind ``model``). Set ``impl_name`` (the registered family),
    ``hf_model_class`` (the transformers class that is the oracle) and ``config_fields`` (the tiny config's fields
    beyond ``TINY_FIELDS``; give a ``sliding_window`` to exercise windows). ``tolerance``: the largest absolute
    float32 logit difference accepted (``packed_tolerance``: with 16-bit packed weights)."""

    kind = "model"
    hf_model_class: ClassVar[str]
    config_fields: ClassVar[dict[str, Any]] = {}
    tolerance: ClassVar[float] = 1e-3
    packed_tolerance: ClassVar[float] = 0.5  # fp16/bf16 weights: the rounding of 16-bit weights, not a wrong layer
    max_tokens: ClassVar[int] = 16
    max_model_len: ClassVar[int] = 256  # the engine's, and the RoPE tables' positions (LongRoPE chooses from it)
    backends: ClassVar[tuple[str, ...]] = ("sdpa", "cpu")

    # -- fixtures ----------------------------------------------------------------------------------------------------

    @classmethod
    def tiny_config(cls) -> Any:
        """The family's tiny HF config: ``TINY_FIELDS`` then ``config_fields``."""
        import transformers

        model_class = getattr(transformers, cls.hf_model_class)
        return model_class.config_class(**{**TINY_FIELDS, **cls.config_fields})

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory) -> Path:
        return save_tiny_model(cls.hf_model_class, cls.tiny_config(), tmp_path_factory.mktemp(cls.impl_name))

    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, model_dir):
        import transformers

        model = getattr(transformers, cls.hf_model_class).from_pretrained(model_dir, dtype=torch.float32)
        return model.eval()

    @property
    def window(self) -> int | None:
        return self.config_fields.get("sliding_window")

    def prompt_lengths(self) -> list[int]:
        """Short and long prompts: the long ones pass the sliding window (and a block boundary) when there is one."""
        long = 3 * (self.window or 8) + 5
        return [3, 11, long, long + 9]

    def load(self, model_dir: Path, architecture=None):
        """infer's model for ``model_dir`` (float32) through the registry, or as ``architecture`` builds it (a
        family with a planted bug)."""
        from infer.model.loader import load_model, read_safetensors

        if architecture is None:
            return load_model(
                str(model_dir), torch.float32, max_positions=self.max_model_len, architecture=self.impl_name
            ).model
        from transformers import AutoConfig

        model = architecture.build(AutoConfig.from_pretrained(model_dir), max_positions=self.max_model_len)
        model.load_hf_state_dict(read_safetensors(Path(model_dir)))
        return model.eval()

    # -- checks (also called with a planted bug, where they must fail) ------------------------------------------------

    def logit_errors(self, model, hf_model, backend: str = "sdpa", kernels: bool = False) -> float:
        """The largest logit difference against HF over a mixed batch: each prompt prefilled in two chunks (the
        second alongside the others' decode steps), then decoded token by token past the window."""
        runner = self.last_runner = PagedRunner(model, backend, kernels=kernels)
        prompts = {f"p{index}": random_prompt(length, seed=index) for index, length in enumerate(self.prompt_lengths())}
        decode = {name: random_prompt(self.max_tokens, seed=100 + index) for index, name in enumerate(prompts)}
        got: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
        halves = {
            name: (tokens[: len(tokens) // 2 + 1], tokens[len(tokens) // 2 + 1 :]) for name, tokens in prompts.items()
        }
        for phase in (0, 1):
            chunk = {name: parts[phase] for name, parts in halves.items() if parts[phase]}
            for name, logits in runner.step(chunk).items():
                got[name].append(logits)
        for position in range(self.max_tokens):
            for name, logits in runner.step({name: [tokens[position]] for name, tokens in decode.items()}).items():
                got[name].append(logits)
        worst = 0.0
        for name, tokens in prompts.items():
            ids = torch.tensor([tokens + decode[name]])
            with torch.inference_mode():
                expected = hf_model(ids).logits[0, : len(tokens) + self.max_tokens - 1].float()
            ours = torch.cat(got[name])[: expected.shape[0]]
            worst = max(worst, (ours - expected).abs().max().item())
        return worst

    def hf_greedy(self, hf_model, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy continuations from HF ``generate``, one prompt at a time."""
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = hf_model.generate(
                    ids,
                    max_new_tokens=self.max_tokens,
                    do_sample=False,
                    pad_token_id=2,
                    attention_mask=torch.ones_like(ids),
                )
            outputs.append(out[0, len(prompt) :].tolist())
        return outputs

    def engine(self, model_dir: Path, **overrides: Any):
        """An ``infer.LLM`` over ``model_dir`` in float32 with config ``overrides`` (``scheduler__...``)."""
        from infer import LLM

        settings = {
            "model__path": str(model_dir),
            "model__dtype": "float32",
            "model__max_model_len": self.max_model_len,
            "model__architecture": self.impl_name,
            **overrides,
        }
        return LLM("baseline", **settings)

    def engine_greedy(self, llm, prompts: list[list[int]]) -> list[list[int]]:
        from infer import SamplingParams

        outputs = llm.generate(prompts, SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
        assert all(output.error is None for output in outputs), [output.error for output in outputs]
        return [output.token_ids for output in outputs]

    def assert_greedy_matches(self, llm, hf_model, prompts) -> None:
        expected = self.hf_greedy(hf_model, prompts)
        for index, (got, want) in enumerate(zip(self.engine_greedy(llm, prompts), expected)):
            # HF stops at EOS; the engine includes the EOS token it stopped on, as HF does.
            assert got == want[: len(got)] and (len(got) == len(want) or got[-1] == 2), (
                f"prompt {index} ({len(prompts[index])} tokens): {got} != {want}"
            )

    def available_backends(self) -> list[str]:
        from infer.kernels import cpu as cpu_kernels

        return [name for name in self.backends if name != "cpu" or cpu_kernels.load("auto") is not None]

    # -- tests -------------------------------------------------------------------------------------------------------

    def test_the_family_serves_its_config(self):
        from infer.registry import get_registry

        family = get_registry().load("model", self.impl_name)
        assert family.serves(self.tiny_config())

    def test_logits_match_hf_at_every_position(self, model_dir, hf_model):
        model = self.load(model_dir)
        for backend in self.available_backends():
            error = self.logit_errors(model, hf_model, backend, kernels=backend == "cpu")
            assert error < self.tolerance, f"{backend}: logits differ from HF by {error}"

    def test_packed_weights_on_the_kernels_stay_close_to_hf(self, model_dir, hf_model):
        """fp16 and bf16 weights through infer's CPU kernels (the fused one-call paths where the family's layers
        are what the C layer computes): logits within the rounding of 16-bit weights."""
        from infer.kernels import cpu as cpu_kernels
        from infer.model.quantization import quantize_model

        if cpu_kernels.load("auto") is None:
            pytest.skip("infer's CPU kernels do not build here")
        for mode in ("fp16", "bf16"):
            model = quantize_model(self.load(model_dir), mode)
            error = self.logit_errors(model, hf_model, "cpu", kernels=True)
            assert error < self.packed_tolerance, f"{mode}: logits differ from HF by {error}"
            counts = self.last_runner.executor.counts
            if all(layer.kernel_shaped for layer in model.layers):
                assert counts["fused-stack"] > 0, self.last_runner.executor.describe()

    def test_a_bf16_checkpoint_read_as_bf16_packs_to_the_same_model(self, model_dir, tmp_path):
        """The family's checkpoint saved in bf16 and read with ``bf16_weights`` (its matrices held as read, never
        widened, as the engine reads a checkpoint it packs) packs to the model the float32 read packs to: the same
        logits, bit for bit, in bf16 and as q4_1 blocks."""
        import shutil

        from infer.model.loader import load_model
        from infer.model.quantization import quantize_model

        bf16_dir = save_in_bf16(shutil.copytree(model_dir, tmp_path / "bf16"))
        settings = dict(max_positions=self.max_model_len, architecture=self.impl_name)
        held = load_model(str(bf16_dir), torch.float32, bf16_weights=True, **settings).model
        assert any(parameter.dtype == torch.bfloat16 for parameter in held.layers.parameters())
        prompts = {f"p{index}": random_prompt(length, seed=index) for index, length in enumerate(self.prompt_lengths())}
        for mode in ("bf16", "q4_1"):
            logits = [
                PagedRunner(quantize_model(model, mode), "sdpa").step(prompts)
                for model in (load_model(str(bf16_dir), torch.float32, **settings).model, copy.deepcopy(held))
            ]
            for name in prompts:
                assert torch.equal(logits[0][name], logits[1][name]), f"{mode}, {name}"

    def test_greedy_mixed_batch_matches_hf(self, model_dir, hf_model):
        prompts = [random_prompt(length, seed=length) for length in self.prompt_lengths()]
        for backend in self.available_backends():
            with self.engine(model_dir, attention__name=backend) as llm:
                self.assert_greedy_matches(llm, hf_model, prompts)

    def test_greedy_under_chunked_prefill_and_preemption_matches_hf(self, model_dir, hf_model):
        lengths = self.prompt_lengths()
        prompts = [random_prompt(length, seed=7 * length) for length in lengths * 2]
        # 7 tokens a step cut every long prompt into chunks; a pool for the longest request and a few blocks more
        # holds fewer sequences than run at once.
        longest = -(-(max(lengths) + self.max_tokens) // 4)
        with self.engine(
            model_dir,
            scheduler__max_num_batched_tokens=7,
            cache__block_size=4,
            cache__num_blocks=longest + 4,
            model__max_model_len=4 * longest,
        ) as llm:
            self.assert_greedy_matches(llm, hf_model, prompts)
            assert llm.engine.stats.num_preemptions > 0, "the pool was large enough that nothing was preempted"

    def test_greedy_with_prefix_cache_hits_matches_hf(self, model_dir, hf_model):
        shared = random_prompt(2 * (self.window or 8) + 6, seed=11)
        prompts = [shared + random_prompt(length, seed=length) for length in (1, 5, 9)]
        for prefix_cache in ("hash", "radix"):
            with self.engine(model_dir, prefix_cache__name=prefix_cache, cache__block_size=4) as llm:
                self.assert_greedy_matches(llm, hf_model, prompts)
                self.assert_greedy_matches(llm, hf_model, prompts)  # the shared prefix and each whole prompt hit
                assert llm.engine.stats.num_cached_prompt_tokens >= len(prompts) * (len(shared) // 4 * 4)

    def test_greedy_with_drafted_tokens_matches_hf(self, model_dir, hf_model):
        """Speculative decoding verified by the family's model: drafts from the model's own first layer
        (self-speculative: the family's layer as the draft model, with its own KV), over prompts longer than the
        sliding window; greedy tokens stay transformers'. (An ngram drafter's guesses reach the same verification
        rows; it reads token ids only, and tests/test_spec_decode.py holds it to the target.)"""
        prompts = [random_prompt(length, seed=2 * length) for length in self.prompt_lengths()]
        with self.engine(model_dir, drafter__name="model", drafter__layers=1) as llm:
            self.assert_greedy_matches(llm, hf_model, prompts)
            assert llm.engine.stats.num_draft_tokens > 0, "nothing was drafted"
