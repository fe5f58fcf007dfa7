"""The README's commands run as written on a fresh clone: every `make` target exists, every `jspec`
command line passes the checks the command runs before it loads a model, every script and linked
file is in the tree, and (slow) the Python example runs on the shipped preset."""

import re
import shlex
from pathlib import Path

import pytest

from jspec import cli
from jspec.bench.cli import check_bench_args
from jspec.bench.protocol import parse_method_specs

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200  # issue 54: a product page, not a lab notebook


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def readme_commands() -> list[list[str]]:
    """Each command line of the README's bash blocks as argv, comments dropped, the command after
    the last pipe."""
    commands = []
    for block in code_blocks(README.read_text(), "bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if "|" in argv:
                argv = argv[len(argv) - argv[::-1].index("|"):]
            if argv:
                commands.append(argv)
    return commands


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE))


def test_readme_is_short_and_its_links_resolve():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (page.parent / target).exists(), f"{page.name} links {target}, which is not in the tree"


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_readme_command_passes_its_checks(argv):
    if argv[0] == "make":
        assert set(argv[1:]) <= make_targets(), argv
    elif argv[:2] == ["python", "-m"] or argv[0] == "python":
        assert (ROOT / argv[1]).is_file(), argv
    else:
        assert argv[0] == "jspec", f"unexpected command in README: {argv}"
        args = cli.build_parser().parse_args(argv[1:])
        if args.cmd == "generate":
            cli.check_generate_args(args)
            cli.read_prompt_texts(args)
        elif args.cmd == "bench":
            check_bench_args(args)
            parse_method_specs(args.methods)


@pytest.mark.slow
def test_readme_python_example_runs_as_written(capsys):
    """The API example on the shipped preset (float32 on a CPU): AR, then the shipped EAGLE-3 head
    named without a path; greedy speculative output is the target's own."""
    (example,) = code_blocks(README.read_text(), "python")
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    res, tok = namespace["res"], namespace["tok"]
    assert res.mean_accepted_tokens.min() > 1.0  # the head's drafts were accepted
    assert capsys.readouterr().out.strip()
    ar = namespace["generate"](namespace["params"], namespace["cfg"], namespace["prompts"], max_new_tokens=32)
    assert [res.row(i) for i in range(2)] == [ar.row(i) for i in range(2)]
    assert tok.decode(res.row(0), skip_special_tokens=True).strip()
