"""megamoe_plugin.model_config reads a model's MoE shape from the config.json keys of each
family it knows (values: the models' published sizes), and names what is wrong otherwise."""
import argparse
import json
from pathlib import Path

import pytest

from megamoe_plugin.model_config import MoEShape, add_shape_arguments, read_config, shape_from_args

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
           "num_experts_per_tok": 2}
# Qwen2-57B-A14B: its shared expert is gated (shared_expert_gate), which the kernel cannot take.
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 3584, "intermediate_size": 18944,
             "moe_intermediate_size": 2560, "shared_expert_intermediate_size": 20480, "num_experts": 64,
             "num_experts_per_tok": 8}
E2E_MODELS = Path(__file__).resolve().parents[1] / "tools" / "e2e" / "models"


@pytest.mark.parametrize("config, expected", [
    (DEEPSEEK_V3, MoEShape(7168, 2048, 256, 8, "deepseek_v3", num_shared_experts=1)),
    (dict(DEEPSEEK_V3, n_shared_experts=None), MoEShape(7168, 2048, 256, 8, "deepseek_v3")),
    (dict(DEEPSEEK_V3, n_shared_experts=0), MoEShape(7168, 2048, 256, 8, "deepseek_v3")),
    (dict(DEEPSEEK_V3, swiglu_limit=10.0), MoEShape(7168, 2048, 256, 8, "deepseek_v3")),
    (QWEN3_MOE, MoEShape(2048, 768, 128, 8, "qwen3_moe")),
    (QWEN2_MOE, MoEShape(3584, 2560, 64, 8, "qwen2_moe")),
    (MIXTRAL, MoEShape(4096, 14336, 8, 2, "mixtral")),
    ({"model_type": "qwen3_vl_moe", "vision_config": {"hidden_size": 1152}, "text_config": QWEN3_MOE},
     MoEShape(2048, 768, 128, 8, "qwen3_moe")),
], ids=["deepseek_v3", "shared_null", "shared_0", "clamped_swiglu", "qwen3_moe", "qwen2_moe_gated_shared", "mixtral", "text_config"])
def test_each_family_reads_from_a_file_or_its_folder(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path / "config.json") == expected
    assert read_config(tmp_path) == expected


@pytest.mark.parametrize("model, shared", [("deepseek_v3_fp8", 1), ("qwen3_moe_fp8", 0)])
def test_the_served_models_shared_experts(model, shared):
    """The e2e models' own config.json files: DeepSeek-V3's n_shared_experts, none in Qwen3-MoE."""
    assert read_config(E2E_MODELS / model).num_shared_experts == shared


def test_a_config_without_model_type_is_named_by_its_folder(tmp_path):
    folder = tmp_path / "My-MoE"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in MIXTRAL.items() if k != "model_type"}))
    assert read_config(folder).name == "My-MoE"


@pytest.mark.parametrize("text, needle", [
    (json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}),
     "no n_routed_experts / num_experts / num_local_experts: not the config of a MoE model"),
    (json.dumps(dict(QWEN3_MOE, num_experts_per_tok="8")), "num_experts_per_tok must be an integer, got '8'"),
    (json.dumps(dict(QWEN3_MOE, num_experts=0)), "num_experts must be an integer >= 1, got 0"),
    (json.dumps(dict(DEEPSEEK_V3, n_shared_experts="1")), "n_shared_experts must be an integer, got '1'"),
    (json.dumps(dict(DEEPSEEK_V3, n_shared_experts=-1)), "num_shared_experts must be an integer >= 0, got -1"),
    ("{not json", "not JSON"),
    ("[1, 2]", "not a config object"),
])
def test_bad_configs_are_named(tmp_path, text, needle):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="config.json: ") as info:
        read_config(path)
    assert needle in str(info.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="config.json: cannot read it"):
        read_config(tmp_path)


def _parse(argv, required):
    parser = argparse.ArgumentParser(prog="prog")
    add_shape_arguments(parser, required)
    return shape_from_args(parser.parse_args(argv), parser, required)


def test_shape_options(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    assert _parse(["--model", str(tmp_path)], True) == MoEShape(4096, 14336, 8, 2, "mixtral")
    assert _parse(["--hidden", "256", "--intermediate-size", "128", "--num-experts", "8", "--topk", "2"], True) == \
        MoEShape(256, 128, 8, 2)
    assert _parse([], False) is None
    for argv, required, needle in ((["--hidden", "256"], False, "all of --hidden --intermediate-size"),
                                   ([], True, "name the model's MoE shape"),
                                   (["--model", str(tmp_path), "--topk", "2"], True, "not both"),
                                   (["--model", str(tmp_path / "nope")], True, "cannot read it")):
        with pytest.raises(SystemExit) as info:
            _parse(argv, required)
        assert info.value.code == 2 and needle in capsys.readouterr().err


def test_shared_experts_option(tmp_path, capsys):
    """--shared-experts gives the numbers form's S (default 0) and overrides a config's, also with 0."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    numbers = ["--hidden", "256", "--intermediate-size", "128", "--num-experts", "8", "--topk", "2"]
    assert _parse(numbers + ["--shared-experts", "2"], True) == MoEShape(256, 128, 8, 2, num_shared_experts=2)
    assert _parse(numbers, True).num_shared_experts == 0
    assert _parse(["--model", str(tmp_path)], True).num_shared_experts == 1
    assert _parse(["--model", str(tmp_path), "--shared-experts", "0"], True).num_shared_experts == 0
    assert _parse(["--model", str(tmp_path), "--shared-experts", "2"], True).num_shared_experts == 2
    assert _parse(["--shared-experts", "1"], False) is None  # no shape named: the caller's own shapes take it
    for argv, needle in ((numbers + ["--shared-experts", "-1"], "argument --shared-experts: expected an integer >= 0, "
                                                                "got '-1'"),
                         (["--model", str(tmp_path), "--shared-experts", "x"], "argument --shared-experts: expected "
                                                                               "an integer >= 0, got 'x'"),
                         (["--shared-experts", "1"], "name the model's MoE shape")):
        with pytest.raises(SystemExit) as info:
            _parse(argv, True)
        assert info.value.code == 2 and needle in capsys.readouterr().err


def test_describe_names_the_shared_experts():
    assert MoEShape(7168, 2048, 256, 8, "deepseek_v3", num_shared_experts=1).describe() == \
        "deepseek_v3: H 7168, I 2048, 256 experts, top-8, 1 shared expert"
    assert MoEShape(2048, 768, 128, 8, "qwen3_moe").describe() == "qwen3_moe: H 2048, I 768, 128 experts, top-8"
    with pytest.raises(ValueError, match="num_shared_experts must be an integer >= 0, got -1"):
        MoEShape(2048, 768, 128, 8, num_shared_experts=-1)
