"""Small builders shared by several test modules."""
import importlib
from pathlib import Path

import torch
import yaml

from quantkit.quant import QuantConfig, QuantizedTensor, default_g_idx
from quantkit.recipe import Recipe, builtin_dir, load_recipe

SMALL_CALIBRATION = {"n_samples": 8, "seq_len": 64, "batch_size": 4}


def built_cpu_ops():
    """The fused C++ operators (quantkit/cpu_ops). A C++ compiler is part of the supported setup, so a
    failed build fails the test instead of quietly testing the PyTorch fallback."""
    from quantkit import cpu_ops

    ops = cpu_ops.load()
    assert ops is not None, "the fused CPU operators did not build"
    return ops


def random_record(config: QuantConfig, n: int, k: int, seed: int, g_idx=None) -> QuantizedTensor:
    """Random codes, zero points (symmetric: 2^(bits-1); asymmetric: from ``config.min_zero``) and
    positive scales in the grid's ``scale_dtype``: a valid record no algorithm produced."""
    gen = torch.Generator().manual_seed(seed)
    groups = config.num_groups(k)
    zeros = torch.randint(config.min_zero, config.maxq + 1, (groups, n), generator=gen, dtype=torch.uint8)
    if config.sym:
        zeros.fill_((config.maxq + 1) // 2)
    return QuantizedTensor(
        codes=torch.randint(0, config.maxq + 1, (n, k), generator=gen, dtype=torch.uint8),
        scales=(torch.rand(groups, n, generator=gen) + 0.01).to(config.scale_dtype),
        zeros=zeros,
        g_idx=default_g_idx(k, config.group_size) if g_idx is None else g_idx,
        config=config,
    )


def small_recipe(name: str, tmp_path, **changes) -> Recipe:
    """Built-in recipe ``name`` on SMALL_CALIBRATION, with top-level ``changes`` (dicts merge)."""
    raw = yaml.safe_load((builtin_dir() / f"{name}.yaml").read_text())
    raw["calibration"].update(SMALL_CALIBRATION)
    for key, value in changes.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_recipe(path)


# Factories that place a tensor on the default device unless given one; torch.from_numpy is not
# overridable, so the NumPy paths are caught by their .numpy() calls instead.
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.eye,
              torch.linspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.as_tensor}


# quantkit's code: the package and the two it maps from the repository's top (kernels/ and eval/)
_PACKAGE_DIRS = tuple(str(Path(importlib.import_module(name).__file__).parent) + "/"
                      for name in ("quantkit", "quantkit.kernels", "quantkit.eval"))


class DeviceAudit(torch.overrides.TorchFunctionMode):
    """Records quantkit lines that create a tensor without naming its device, or turn one into NumPy
    without .cpu(): on a CUDA run the first lands on the CPU beside GPU operands, the second raises.
    --device cuda cannot run where quantkit is tested, so tests prove on the CPU the property it needs."""

    def __init__(self):
        super().__init__()
        self.found: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import traceback

        kwargs = kwargs or {}
        to_numpy = func is torch.Tensor.numpy
        if to_numpy or (func in _FACTORIES and kwargs.get("device") is None):
            ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(_PACKAGE_DIRS)]
            if ours and not (to_numpy and ".cpu()" in (ours[-1].line or "")):
                self.found.add(f"{Path(ours[-1].filename).name}:{ours[-1].lineno} {func.__name__}: {ours[-1].line}")
        return func(*args, **kwargs)


# Installed first in a child Python: every import of the named top-level packages fails, as when they
# are not installed (find_spec raising ImportError stops the search before any later finder).
_BLOCKER = '''
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, _Blocked())
'''


def run_without(blocked: set[str], code: str, *args: str, env: dict | None = None):
    """Run ``code`` (``python -c``) in a child Python where importing ``blocked``'s packages fails; no
    standard input (nothing it runs may wait for an answer), ``env`` added to the environment. It runs in
    the temporary directory, not the checkout: ``python -c`` puts its working directory on sys.path, where
    the checkout's kernels/ folder would hide Hugging Face's ``kernels`` from transformers."""
    import os
    import subprocess
    import sys
    import tempfile

    return subprocess.run([sys.executable, "-c", _BLOCKER.format(blocked=blocked) + code, *args],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600,
                          env={**os.environ, **(env or {})}, cwd=tempfile.gettempdir())


TIMEOUT = 240  # seconds for one torchrun job: a hang fails its test instead of stalling the suite
# every rank on one thread; a rank that dies of a signal (SIGABRT, SIGSEGV) prints each of its threads' Python
# stack (faulthandler) before the job's own report of the failure
JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}


def job_failure(stderr: str) -> str:
    """What a failed job printed: the ranks' own lines first (a crashed rank's stacks), torchrun's report last."""
    return stderr if len(stderr) <= 8000 else f"{stderr[:5000]}\n[...]\n{stderr[-3000:]}"


def torchrun(ranks: int, *args: str, check: bool = True, logs: Path | None = None):
    """A gloo job of ``ranks`` processes of one thread each, meeting on a free port (--standalone); with
    ``logs``, each rank's stderr goes to a file of its own there (tests/test_distributed*.py)."""
    import os
    import subprocess
    import sys

    own_logs = ["--log-dir", str(logs), "--redirects", "2"] if logs else []
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           *own_logs, *args], env={**os.environ, **JOB_ENV}, capture_output=True,
                          text=True, timeout=TIMEOUT)
    if check:
        assert done.returncode == 0, job_failure(done.stderr)
    return done


def write_sentencepiece_tokenizer(folder: Path) -> None:
    """Give the tiny checkpoint ``folder`` (of vocab_size 1216) a SentencePiece BPE tokenizer like MiniCPM4.1's
    own (tokenizer.model, byte fallback, no normalization, chat tokens added on top as ids 1200 and 1201),
    trained here on the shipped calibration text, in place of its byte-level one."""
    import json

    import sentencepiece

    import quantkit.calib_data

    data = Path(quantkit.calib_data.__file__).parent
    lines = [line for name in ("en_calib.txt", "zh_calib.txt", "code_calib.txt")
             for line in (data / name).read_text().splitlines()[:400] if line.strip()]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"), vocab_size=1200, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "added_tokens_decoder": {
        "1200": {"content": "<|im_start|>", "special": True}, "1201": {"content": "<|im_end|>", "special": True}}}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2,
                                                     "pad_token_id": None}))
