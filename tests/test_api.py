"""The four-verb Python API is the commands' library: same artifacts, same numbers."""
import json

import torch

import quantkit
from quantkit.loading import load_model
from quantkit.reader import ArtifactReader

from helpers import SMALL_CALIBRATION


def test_quantize_load_export_evaluate(tiny_checkpoint, tmp_path):
    out = tmp_path / "rtn"
    report = quantkit.quantize(tiny_checkpoint, "rtn-w4g128", out, progress=False, quant={"bits": 8, "group_size": 64},
                               calibration=SMALL_CALIBRATION, format="gptq-v2")
    assert len(report.layers) == ArtifactReader(out).num_layers
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (quant["bits"], quant["group_size"], quant["checkpoint_format"]) == (8, 64, "gptq_v2")
    model = quantkit.load(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), load_model(out).state_dict().values()))
    gguf = quantkit.export_gguf(out, tmp_path / "rtn.gguf", "q8_0", progress=False)
    assert gguf.file_bytes == (tmp_path / "rtn.gguf").stat().st_size > 0
    scores = quantkit.evaluate(out, ref=tiny_checkpoint, max_tokens=300, window=128)
    assert scores["tokens"] > 100 and 0 < scores["mean_kl"] < 0.05 and scores["top1_agreement"] > 0.8
    assert quantkit.evaluate(tiny_checkpoint, ref=tiny_checkpoint, max_tokens=300, window=128)["mean_kl"] < 1e-9
