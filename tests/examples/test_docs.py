"""The documentation: docstring examples run and print what they say, relative links lead somewhere, and the code
the README and docs/ give to run runs as written."""

import doctest
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON, ROOT

import roformer_hf

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", ROOT / "examples" / "README.md",
         ROOT / "benchmarks" / "RESULTS.md",
         *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC = [roformer_hf.RoFormerConfig, *(head.model_class for head in roformer_hf.modeling.HEADS),
          roformer_hf.loading.register_hook, roformer_hf.loading.RefusesSaving, roformer_hf.fused.FusesPostOps]


@pytest.mark.parametrize("cls", PUBLIC, ids=lambda cls: cls.__name__)
def test_docstring_example_runs(cls):
    blocks = re.findall(r"```python\n(.*?)```", cls.__doc__ or "", flags=re.DOTALL)
    assert blocks, f"{cls.__name__} has no runnable example"
    test = doctest.DocTestParser().get_doctest("".join(blocks), {}, cls.__name__, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL),
                          re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page != ROOT / "README.md", "the README links nowhere: the pattern is wrong"
    for link in links:
        if re.match(r"[a-z]+://|mailto:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name} links to {link}, which does not exist"
        if anchor:
            assert target.suffix == ".md" and anchor in anchors(target), f"{page.name}: no heading for {link}"


def python_block(page: str, containing: str) -> str:
    """The one python block of `page` that contains `containing`."""
    blocks = [block for block in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.DOTALL)
              if containing in block]
    assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks contain {containing!r}"
    return blocks[0]


NOT_RUN = re.compile(r"<!-- not run by the docs test: (.+?) -->\n```python\n")
RESULT = "docs-test-result: "
# Takes one page's blocks per line of stdin; runs each in a fresh namespace and a fresh working folder, stopping at
# the first that fails; answers one line (after RESULT) per page. One process for every page, to pay the imports
# once: a page starts from the process state the pages before it left (modules imported, seeds, registrations), as
# each block of a page always has from the blocks before it; the names a block defines never reach another block.
RUN_BLOCKS = """
import contextlib, io, json, os, sys, tempfile, traceback
for line in sys.stdin:
    output, error = io.StringIO(), None
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
        for index, block in json.loads(line):
            os.chdir(tempfile.mkdtemp())
            try:
                exec(compile(block, f"block {index}", "exec"), {"__name__": "__main__"})
            except BaseException:
                error = f"block {index} failed:\\n{traceback.format_exc()}"
                break
    print(RESULT + json.dumps({"error": error, "output": output.getvalue()[-4000:]}), flush=True)
""".replace("RESULT", repr(RESULT))


def page_blocks(page: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """A page's python blocks to run, with their index on the page, and the reasons given for those not run."""
    text = page.read_text(encoding="utf-8")
    blocks = [(match.start(), match.group(1)) for match in re.finditer(r"```python\n(.*?)```", text, flags=re.DOTALL)]
    skipped = {match.end() - len("```python\n"): match.group(1) for match in NOT_RUN.finditer(text)}
    return [(i, block) for i, (start, block) in enumerate(blocks) if start not in skipped], list(skipped.values())


CODE_PAGES = [page for page in PAGES if page.parent == ROOT / "docs" or page == ROOT / "README.md"]


@pytest.fixture(scope="module")
def block_runner():
    """The process that runs the pages' blocks (`RUN_BLOCKS`), started once for the module."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    runner = subprocess.Popen([PYTHON, "-c", RUN_BLOCKS], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    yield runner
    runner.stdin.close()
    runner.wait(timeout=60)


SLOW_PAGES = {"export.md"}  # its blocks compile with inductor
SERVER_PAGES = {"serving.md"}  # its blocks talk to servers: `test_serving_page_runs_against_servers_it_starts`


@pytest.mark.parametrize("page", [pytest.param(page, marks=[pytest.mark.slow] if page.name in SLOW_PAGES else [])
                                  for page in CODE_PAGES if page_blocks(page)[0] and page.name not in SERVER_PAGES],
                         ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_python_block_runs_as_written(page, block_runner):
    """Each block on its own: its imports, its data, nothing from the blocks before it."""
    blocks, _ = page_blocks(page)
    block_runner.stdin.write(json.dumps(blocks) + "\n")
    block_runner.stdin.flush()
    for line in block_runner.stdout:  # what a block's subprocesses print to this stdout comes first
        if line.startswith(RESULT):
            result = json.loads(line[len(RESULT):])
            break
    else:
        pytest.fail(f"{page.name}: the block runner exited ({block_runner.wait()})")
    assert result["error"] is None, f"{page.name}: {result['error']}\n{result['output']}"


def test_blocks_the_docs_test_does_not_run_say_why():
    reasons = [reason for page in CODE_PAGES for reason in page_blocks(page)[1]]
    assert len(reasons) <= 4 and all(len(reason) > 20 for reason in reasons), reasons


def test_readme_quick_start_runs_as_written(tmp_path, local_hub):
    """Train, save, reload, push (to a local Hub) and summarise, exactly as the README says."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": local_hub.url, "HF_TOKEN": "dummy",
           "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run([PYTHON, "-c", python_block("README.md", "runs/quickstart")], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = tmp_path / "runs" / "quickstart" / "model"
    assert {"model.safetensors", "config.json", "modeling.py", "README.md", "tokenizer.json"} <= {
        path.name for path in saved.iterdir()}
    assert "RoFormerLayer" in result.stdout and "Total params" in result.stdout
    pushed = local_hub.files("you/roformer-quickstart")
    assert {"model.safetensors", "config.json", "modeling.py", "README.md", "tokenizer.json"} <= set(pushed)
    assert "hub.py" not in pushed


GUIDES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")  # hex with a letter and a digit


@pytest.mark.parametrize("page", GUIDES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_guides_carry_no_dates_or_commits(page):
    """benchmarks/RESULTS.md keeps each figure with its date, machine and commit; a guide states the current figure
    with the machine kind and links to its entry there (the link's target may name the entry's date)."""
    text = re.sub(r"\]\((?:\.\./)?benchmarks/RESULTS\.md#[^)]*\)", "]()", page.read_text(encoding="utf-8"))
    found = [f"line {number}: {match.group()}" for number, line in enumerate(text.splitlines(), 1)
             for match in [*DATE.finditer(line), *COMMIT.finditer(line)]]
    assert not found, f"{page.name} carries dates or commits: {found}"


def test_guides_date_and_commit_patterns_find_what_they_should():
    assert DATE.findall("measured 2026-11-28 on 2 cores, not 2026-1-2") == ["2026-11-28"]
    assert COMMIT.findall("at 1b46df8 and c09f1c5; not facade, 1234567, 0.999606 or cl100k") == ["1b46df8", "c09f1c5"]


def test_contributing_names_every_module():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    modules = sorted((ROOT / "roformer_hf").rglob("*.py"))
    assert modules
    missing = [module.relative_to(ROOT).as_posix() for module in modules
               if f"`{module.relative_to(ROOT).as_posix()}`" not in text and f"`{module.name}`" not in text]
    assert not missing, f"CONTRIBUTING.md's table of where things are does not name {missing}"


def test_the_reference_tables_are_what_the_code_gives():
    """docs/reference.md is generated (`python docs/make_reference.py`): a field, head or checkpoint kind changed in
    the code without regenerating it fails here, and so does a config field without a meaning in its docstring."""
    completed = subprocess.run([PYTHON, str(ROOT / "docs" / "make_reference.py"), "--check"], capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr[-2000:]


def _faq_errors(tmp_path, monkeypatch) -> list[str]:
    """The errors docs/faq.md quotes, in its order, as the code raises them."""
    import builtins

    import torch

    from roformer_hf import RoFormerConfig, RoFormerForCausalLM, RoFormerHFTokenizer, RoFormerModel
    from roformer_hf.cli import port_refusal

    def raised(action) -> str:
        with pytest.raises((ValueError, OSError, ImportError)) as error:
            action()
        return str(error.value)

    small = RoFormerConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32)
    pickled = tmp_path / "pickled"
    small.save_pretrained(pickled)
    torch.save(RoFormerModel(small).state_dict(), pickled / "pytorch_model.bin")

    real_import = builtins.__import__

    def without_rjieba(name, *args, **kwargs):
        if name == "rjieba":
            raise ImportError("No module named 'rjieba'")
        return real_import(name, *args, **kwargs)

    def jieba_tokenizer():
        with monkeypatch.context() as patch:
            patch.setattr(builtins, "__import__", without_rjieba)
            RoFormerHFTokenizer(use_jieba=True)

    decoder = RoFormerForCausalLM(decoder_config := RoFormerConfig(**{**small.to_dict(), "is_decoder": True}))
    assert decoder_config.head_dim == 8
    cache = decoder(torch.randint(5, 100, (2, 5)), use_cache=True).past_key_values
    with socket.socket() as server:  # whatever holds the port the command is told to serve on
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        port_taken = port_refusal("127.0.0.1", port).replace(str(port), "8000")
    return [
        raised(lambda: RoFormerModel.from_pretrained(pickled)),
        raised(jieba_tokenizer),
        raised(lambda: RoFormerModel(small)(torch.tensor([[2, 500, 3]]))),
        raised(lambda: decoder(torch.randint(5, 100, (3, 1)), past_key_values=cache)),
        port_taken,
    ]


def test_the_troubleshooting_page_quotes_the_errors_users_see(tmp_path, monkeypatch):
    quotes = re.findall(r"```text\n(.*?)\n```", (ROOT / "docs" / "faq.md").read_text(encoding="utf-8"), re.DOTALL)
    errors = _faq_errors(tmp_path, monkeypatch)
    assert len(quotes) == len(errors)
    for quote, error in zip(quotes, errors):
        assert quote in error, (quote, error)


def _serve(folder: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RAY_worker_niceness": "0"}
    return subprocess.Popen([PYTHON, "-m", "roformer_hf.cli", "serve", str(folder), "--port", str(port), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_healthy(url: str, server: subprocess.Popen, deadline_s: float) -> None:
    import time
    import urllib.request

    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}): {server.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"{url}/health not answering within {deadline_s} s")


def _stop(server: subprocess.Popen) -> None:
    import signal

    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)  # the command shuts Ray Serve down, HAProxy with it
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.mark.slow
def test_serving_page_runs_against_servers_it_starts(tmp_path):
    """docs/serving.md as a user pastes it: `roformer-hf serve` (the command, its default ingress) on a RoFormer-Sim
    named `roformer` at the page's port 8000 and on a cross-encoder at 8001, here on free ports; every `curl` line
    (with `--fail`) and every python block runs against them; then Prometheus shows the requests."""
    import shutil

    import torch
    from helpers import free_port, save_folder, serving_tokenizer, tiny_config

    from roformer_hf import RoFormerForCausalLM, RoFormerForSequenceClassification

    tokenizer = serving_tokenizer()
    torch.manual_seed(0)
    lm = save_folder(RoFormerForCausalLM(tiny_config(vocab_size=len(tokenizer), is_decoder=True, prefix_lm=True,
                                                     add_pooling_layer=True)).eval(),  # RoFormer-Sim: /similar too
                     tokenizer, tmp_path / "my-model")
    cross_encoder = RoFormerForSequenceClassification(tiny_config(vocab_size=len(tokenizer), num_labels=1)).eval()
    reranker = save_folder(cross_encoder, tokenizer, tmp_path / "my-reranker")
    ports, metrics = {"8000": free_port(), "8001": free_port()}, free_port()
    servers = [_serve(lm, ports["8000"], "--served-model-name", "roformer", "--metrics-port", str(metrics)),
               _serve(reranker, ports["8001"])]
    try:
        for port, server in zip(ports.values(), servers):
            _wait_healthy(f"http://127.0.0.1:{port}", server, 300)
        text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
        for page_port, port in ports.items():
            text = text.replace(f"localhost:{page_port}", f"127.0.0.1:{port}").replace(
                f"127.0.0.1:{page_port}", f"127.0.0.1:{port}")
        bash = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL))
        commands = re.findall(r"^(curl .*?)(?<!\\)$", bash.replace("\\\n", " "), flags=re.MULTILINE)
        assert len(commands) >= 8, commands
        if shutil.which("curl"):
            for command in commands:
                done = subprocess.run(command.replace("curl ", "curl --fail --max-time 60 ", 1), shell=True,
                                      capture_output=True, text=True, timeout=90)
                assert done.returncode == 0, (command, done.stdout[-500:], done.stderr[-500:])
        blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
        assert len(blocks) >= 3
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for block in blocks:
            done = subprocess.run([PYTHON, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == 0, (block, done.stderr[-3000:])
        # The requests above, counted by Ray Serve and by the replica's batches, on the Prometheus port.
        import time
        import urllib.request

        wanted = ("ray_serve_num_http_requests_total", "ray_roformer_batch_tokens_bucket")
        seen, start = "", time.monotonic()
        while not all(name in seen for name in wanted) and time.monotonic() - start < 60:
            time.sleep(2)
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as answer:
                seen = answer.read().decode()
        assert all(name in seen for name in wanted), [name for name in wanted if name not in seen]
    finally:
        for server in servers:
            _stop(server)
