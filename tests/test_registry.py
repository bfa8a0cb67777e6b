"""The registry: built-ins, compiled:NAME, file and module plug-ins, entry points, and the errors users get."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from torch import nn

from attnbench import registry
from attnbench.errors import AttnbenchError, PluginLoadError, UnavailableError, UnknownImplementationError
from attnbench.spec import AttnSpec
from attnbench.weights import export_weights, random_weights

pytestmark = pytest.mark.usefixtures("single_thread")

BUILTINS = {"wrapper", "weight_split", "fused_qkv", "einsum", "per_head_linear", "sdpa", "sdpa_math", "sdpa_flash",
            "sdpa_efficient", "sdpa_cudnn", "sdpa_mask", "torch_mha", "flex"}
SPEC = AttnSpec(6, 8, 5, 0.0, 2)
NO_CUDA = not torch.cuda.is_available()


def test_builtins_are_registered():
    names = registry.names()
    assert BUILTINS <= set(names)
    assert len(names) == len(set(names))
    for name in BUILTINS:
        impl = registry.get(name)
        assert impl.name == name and impl.origin == "builtin"
        assert impl.description and impl.source


def test_get_returns_the_same_object_and_strips_spaces():
    assert registry.get(" sdpa ") is registry.get("sdpa")


def test_builtin_builds_the_spec_on_cpu_in_the_dtype():
    module = registry.get("fused_qkv").build(SPEC, "cpu", "float64")
    assert isinstance(module, nn.Module)
    assert all(p.dtype == torch.float64 for p in module.parameters())
    assert module(torch.randn(2, 5, 6, dtype=torch.float64)).shape == (2, 5, 8)


def test_available_on_cpu():
    avail = registry.available("cpu")
    assert {"weight_split", "sdpa", "sdpa_math", "einsum"} <= set(avail)
    if NO_CUDA:
        assert "sdpa_efficient" not in avail and "sdpa_cudnn" not in avail


def test_unknown_name_suggests_close_match():
    with pytest.raises(UnknownImplementationError, match=r"did you mean weight_split\?") as info:
        registry.get("weight_splt")
    assert isinstance(info.value, KeyError) and isinstance(info.value, AttnbenchError)
    assert not str(info.value).startswith("'")  # not quoted like a bare KeyError
    with pytest.raises(UnknownImplementationError, match="attnbench list"):
        registry.get("completely_different_zzz")


def test_malformed_colon_names():
    for name in (":Cls", "mod:"):
        with pytest.raises(UnknownImplementationError, match="path/to/file.py:Class"):
            registry.get(name)


# --- compiled:NAME ------------------------------------------------------------------------------

def test_compiled_name_resolves_as_a_transform():
    impl = registry.get("compiled:weight_split@max-autotune")
    assert impl.name == "compiled:weight_split@max-autotune"
    assert "torch.compile" in impl.description and "max-autotune" in impl.description
    assert impl.transform is not None and registry.get("weight_split").transform is None
    module = impl.build(SPEC, "cpu", torch.float32, weights=random_weights(SPEC, dtype=torch.float32))
    assert hasattr(module, "_orig_mod")  # compiled lazily: nothing is compiled until called
    assert torch.equal(export_weights(module, SPEC).W_q, random_weights(SPEC, dtype=torch.float32).W_q)


def test_compiled_name_errors():
    with pytest.raises(UnknownImplementationError, match="reduce-overhead"):
        registry.get("compiled:weight_split@fastest")
    with pytest.raises(UnknownImplementationError, match="compiles twice"):
        registry.get("compiled:compiled:sdpa")
    with pytest.raises(UnknownImplementationError, match="did you mean sdpa"):
        registry.get("compiled:sdpx")


# --- file and module plug-ins ---------------------------------------------------------------------

def test_file_plugin_loads_and_builds(repo_cwd):
    impl = registry.get("tests/plugins/good.py:PlainAttention")
    assert impl.origin == "file" and impl.source.endswith("good.py")
    assert impl.description.startswith("Causal multi-head attention written out")
    module = impl.build(SPEC)
    assert type(module).__name__ == "PlainAttention"
    assert module(torch.randn(1, 3, 6)).shape == (1, 3, 8)


def test_file_plugin_missing_file(repo_cwd):
    with pytest.raises(PluginLoadError, match="does not exist"):
        registry.get("tests/plugins/no_such_file.py:Anything")


def test_file_plugin_missing_class_lists_classes(repo_cwd):
    with pytest.raises(PluginLoadError, match="has no attribute 'NoSuchClass'") as info:
        registry.get("tests/plugins/good.py:NoSuchClass")
    assert "PlainAttention" in str(info.value) and "SDPAAttention" in str(info.value)
    with pytest.raises(PluginLoadError, match="PlainAttention"):  # a typo gets the close match
        registry.get("tests/plugins/good.py:PlainAtention")


def test_file_plugin_that_is_not_python(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("this is not python(\n")
    with pytest.raises(PluginLoadError, match="importing plug-in 'broken.py' failed: SyntaxError"):
        registry.get("broken.py:Anything")


def test_plugin_object_that_is_not_a_class(repo_cwd):
    with pytest.raises(PluginLoadError, match="nn.Module subclass"):
        registry.get("tests/plugins/bad.py:NOT_A_CLASS")


def test_plugin_constructor_error_is_plugin_load_error(repo_cwd):
    impl = registry.get("tests/plugins/bad.py:RaisesInInit")  # resolving does not build
    with pytest.raises(PluginLoadError, match="RaisesInInit.*ValueError: RaisesInInit refuses to be built"):
        impl.build(SPEC)


def test_factory_returning_non_module(isolated_registry):
    registry.register("returns_int", lambda spec: 42, description="not a module")
    with pytest.raises(PluginLoadError, match="returned int, not an nn.Module"):
        registry.get("returns_int").build(SPEC)


def test_module_plugin(plugins_on_path, isolated_registry):
    impl = registry.get("good:SDPAAttention")
    assert impl.origin == "module" and impl.source == "good:SDPAAttention"
    assert impl.build(SPEC)(torch.randn(2, 4, 6)).shape == (2, 4, 8)


def test_module_plugin_missing_module():
    with pytest.raises(PluginLoadError, match="module 'no_such_module_xyz.sub' not found.*PYTHONPATH"):
        registry.get("no_such_module_xyz.sub:Cls")


# --- register, capabilities, entry points ---------------------------------------------------------

def test_register_decorator_and_unregister(isolated_registry):
    @registry.register("toy", devices=("cpu",), dropout=False)
    class Toy(nn.Module):
        """A toy layer."""

        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__()
            self.args = (d_in, d_out, context_length, dropout, num_heads, qkv_bias)

    impl = registry.get("toy")
    assert impl.description == "A toy layer." and impl.dropout == () and impl.backward == ("cpu", "cuda")
    assert impl.build(AttnSpec(3, 4, 5, 0.1, 2, True)).args == (3, 4, 5, 0.1, 2, True)  # the book's order
    assert impl.unavailable_reason("cuda") is not None
    registry.unregister("toy")
    with pytest.raises(UnknownImplementationError):
        registry.get("toy")


def test_entry_point_plugins(plugins_on_path, isolated_registry, monkeypatch):
    group = registry.ENTRY_POINT_GROUP
    eps = [importlib.metadata.EntryPoint(name="ep_plain", value="good:PlainAttention", group=group),
           importlib.metadata.EntryPoint(name="ep_broken", value="no_such_module_xyz:Cls", group=group),
           importlib.metadata.EntryPoint(name="weight_split", value="good:SDPAAttention", group=group)]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [ep for ep in eps if ep.group == kw.get("group")])
    names = registry.names()
    assert max(names.index(n) for n in BUILTINS) < names.index("ep_plain")  # built-ins first

    plain = registry.get("ep_plain")
    assert plain.origin == "entry-point" and plain.source == "good:PlainAttention"
    assert type(plain.build(SPEC)).__name__ == "PlainAttention"

    broken = registry.get("ep_broken")  # listed, but unavailable with the reason
    reason = broken.unavailable_reason("cpu")
    assert reason and "failed to load" in reason and "ModuleNotFoundError" in reason
    assert "ep_broken" not in registry.available("cpu")
    with pytest.raises(UnavailableError, match="failed to load"):
        broken.build(SPEC)

    # an entry point cannot replace a built-in
    assert registry.get("weight_split").origin == "builtin"


def test_entry_point_capabilities_attribute(plugins_on_path, isolated_registry, monkeypatch):
    import good

    monkeypatch.setattr(good.PlainAttention, "attnbench_capabilities",
                        {"dropout": False, "description": "declared", "devices": ("cpu",)}, raising=False)
    ep = importlib.metadata.EntryPoint(name="ep_caps", value="good:PlainAttention", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [ep])
    impl = registry.get("ep_caps")
    assert impl.description == "declared" and impl.dropout == () and impl.devices == ("cpu",)


# --- availability --------------------------------------------------------------------------------

@pytest.mark.skipif(not NO_CUDA, reason="checks the no-CUDA message")
def test_cuda_only_implementation_on_cpu_is_unavailable():
    impl = registry.get("sdpa_efficient")
    assert impl.unavailable_reason("cpu") == "needs CUDA"
    with pytest.raises(UnavailableError, match="sdpa_efficient cannot run on cpu.*needs CUDA"):
        impl.build(SPEC, "cpu")


@pytest.mark.skipif(not NO_CUDA, reason="checks the no-CUDA message")
def test_cuda_device_without_cuda():
    with pytest.raises(UnavailableError, match="CUDA is not available"):
        registry.get("weight_split").build(SPEC, "cuda")


def test_same_width_only():
    impl = registry.get("torch_mha")
    with pytest.raises(UnavailableError, match="d_in == d_out"):
        impl.build(SPEC)
    assert impl.build(AttnSpec(8, 8, 5, 0.0, 2))(torch.randn(1, 5, 8)).shape == (1, 5, 8)


def test_unsupported_dtype_is_a_user_error():
    with pytest.raises(AttnbenchError, match="unknown dtype"):
        registry.get("weight_split").build(SPEC, "cpu", "float8")


def test_check_adapter(repo_cwd):
    registry.check_adapter(registry.get("fused_qkv"), SPEC)
    registry.check_adapter(registry.get("tests/plugins/bad.py:NoBookNames"), SPEC)  # q, k, v, o: found by name
    with pytest.raises(PluginLoadError, match="no recognisable projections"):
        registry.check_adapter(registry.get("tests/plugins/styles/errors.py:NoRecognisableProjections"), SPEC)
