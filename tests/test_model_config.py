"""megamoe_plugin.model_config reads a model's MoE shape from the config.json keys of each
family it knows (values: the models' published sizes), and names what is wrong otherwise."""
import argparse
import json

import pytest

from megamoe_plugin.model_config import MoEShape, add_shape_arguments, read_config, shape_from_args

DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
           "num_experts_per_tok": 2}


@pytest.mark.parametrize("config, expected", [
    (DEEPSEEK_V3, MoEShape(7168, 2048, 256, 8, "deepseek_v3")),
    (QWEN3_MOE, MoEShape(2048, 768, 128, 8, "qwen3_moe")),
    (MIXTRAL, MoEShape(4096, 14336, 8, 2, "mixtral")),
    ({"model_type": "qwen3_vl_moe", "vision_config": {"hidden_size": 1152}, "text_config": QWEN3_MOE},
     MoEShape(2048, 768, 128, 8, "qwen3_moe")),
], ids=["deepseek_v3", "qwen3_moe", "mixtral", "text_config"])
def test_each_family_reads_from_a_file_or_its_folder(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_config(tmp_path / "config.json") == expected
    assert read_config(tmp_path) == expected


def test_a_config_without_model_type_is_named_by_its_folder(tmp_path):
    folder = tmp_path / "My-MoE"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in MIXTRAL.items() if k != "model_type"}))
    assert read_config(folder).name == "My-MoE"


@pytest.mark.parametrize("text, needle", [
    (json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}),
     "no n_routed_experts / num_experts / num_local_experts: not the config of a MoE model"),
    (json.dumps(dict(QWEN3_MOE, num_experts_per_tok="8")), "num_experts_per_tok must be an integer, got '8'"),
    (json.dumps(dict(QWEN3_MOE, num_experts=0)), "num_experts must be a positive integer, got 0"),
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
