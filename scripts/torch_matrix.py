"""Run the test suite on every supported torch, each in a throw-away environment.

For each version it creates (or reuses) a virtual environment outside the repository,
``/tmp/ffsdp-torch-<version>``, installs that torch and then this project with its test extra
(``pip install -e '.[test]'``), runs the suite and records the counts. The results replace the
generated table in ``docs/compatibility.md`` (between the ``matrix:begin``/``matrix:end``
markers); the prose around it is written by hand.

Only torch 2.13.0 has a CPU build on the package index this project uses; the other versions
install as the default wheels with their ``nvidia-*`` packages (about 5 GB per environment).
A pip configuration that caps torch versions would stop those installs, so pip runs with
``PIP_CONFIG_FILE=/dev/null``.

Usage::

    python scripts/torch_matrix.py                      # every supported version
    python scripts/torch_matrix.py 2.15.0 2.11.0        # some of them
    python scripts/torch_matrix.py --install-only       # only build the environments
    python scripts/torch_matrix.py 2.15.0 -- tests/test_mixed_precision.py  # a subset

Run it niced on a shared machine (``nice -n 19 python scripts/torch_matrix.py``): the suite
uses every core.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "compatibility.md"
BEGIN = "<!-- matrix:begin -->"
END = "<!-- matrix:end -->"

#: The newest patch release of every minor version ``pyproject.toml`` admits.
VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")


def venv_dir(version: str) -> Path:
    """Where the throw-away environment for ``version`` lives (outside the repository)."""
    return Path(f"/tmp/ffsdp-torch-{version}")


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PIP_CONFIG_FILE"] = "/dev/null"  # lifts a configuration that caps torch versions
    env.pop("PIP_CONSTRAINT", None)
    env.pop("PIP_FIND_LINKS", None)
    return env


def _installed_torch(python: Path) -> str | None:
    """The torch version of a complete environment (the project and its test extra import)."""
    if not python.exists():
        return None
    check = "import functional_fsdp, pytest, hypothesis, xdist, torchao, torch; print(torch.__version__)"
    out = subprocess.run(
        [str(python), "-c", check],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() if out.returncode == 0 else None


def install(version: str, wheel_dir: str | None) -> tuple[Path, float]:
    """Create the environment for ``version`` unless it already holds that torch.

    Returns the environment's python and the seconds the install took (0.0 when reused).
    """
    env_dir = venv_dir(version)
    python = env_dir / "bin" / "python"
    have = _installed_torch(python)
    if have is not None and have.split("+")[0] == version:
        return python, 0.0
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(env_dir)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True, env=_pip_env())
    find = ["--find-links", wheel_dir] if wheel_dir else []
    subprocess.run(pip + find + [f"torch=={version}"], check=True, env=_pip_env())
    # torch named again: pip keeps this version or fails, rather than replacing it with the
    # newest torch when pyproject.toml's range does not admit it.
    subprocess.run(
        pip + find + ["-e", ".[test]", f"torch=={version}"], check=True, env=_pip_env(), cwd=ROOT
    )
    got = _installed_torch(python)
    if got is None or got.split("+")[0] != version:
        raise RuntimeError(f"{env_dir}: wanted torch {version}, the environment has {got}")
    return python, time.monotonic() - start


def run_suite(python: Path, version: str, pytest_args: list[str]) -> dict:
    """Run pytest in ``python``'s environment and return its counts and failures."""
    xml = Path(f"/tmp/ffsdp-torch-{version}.junit.xml")
    xml.unlink(missing_ok=True)
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    start = time.monotonic()
    proc = subprocess.run(cmd + pytest_args, cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    log = Path(f"/tmp/ffsdp-torch-{version}.log")
    log.write_text(proc.stdout + proc.stderr)
    return read_results(version, proc.returncode, seconds)


def read_results(version: str, rc: int | None = None, seconds: float | None = None) -> dict:
    """Counts and failures of ``version``'s last run, from its JUnit XML (``--collect``
    reads them again, e.g. after runs started with ``--no-doc``)."""
    xml = Path(f"/tmp/ffsdp-torch-{version}.junit.xml")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[tuple[str, str]] = []
    if xml.exists():
        root = ET.parse(xml).getroot()
        if seconds is None:
            seconds = sum(float(s.get("time", 0)) for s in root.iter("testsuite"))
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if case.find("skipped") is not None:
                counts["skipped"] += 1
            elif bad is not None:
                counts["failed" if bad.tag == "failure" else "errors"] += 1
                message = (bad.get("message") or "").strip().splitlines()
                first = " ".join(message[0].split()) if message else ""
                failures.append((name, first.encode("ascii", "replace").decode()[:160]))
            else:
                counts["passed"] += 1
    if rc is None:
        rc = 1 if counts["failed"] or counts["errors"] or not xml.exists() else 0
    return {
        "version": version,
        "rc": rc,
        "seconds": seconds or 0.0,
        "counts": counts,
        "failures": failures,
        "log": f"/tmp/ffsdp-torch-{version}.log",
    }


def _table(results: list[dict], pytest_args: list[str]) -> str:
    scope = " ".join(pytest_args) if pytest_args else "the full suite"
    lines = [
        BEGIN,
        f"Generated by `scripts/torch_matrix.py` ({scope}, CPU, gloo), "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "| torch | passed | failed | errors | skipped | minutes | failing tests |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r["counts"]
        failing = "; ".join(f"`{n}`: {m}".replace("|", "\\|") for n, m in r["failures"]) or "—"
        lines.append(
            f"| {r['version']} | {c['passed']} | {c['failed']} | {c['errors']} | "
            f"{c['skipped']} | {r['seconds'] / 60:.1f} | {failing} |"
        )
    lines.append(END)
    return "\n".join(lines)


def write_doc(results: list[dict], pytest_args: list[str]) -> None:
    """Replace the generated table in docs/compatibility.md, keeping rows of versions not run."""
    text = DOC.read_text() if DOC.exists() else f"# Compatibility\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    old, _, tail = rest.partition(END)
    kept = {}
    for line in old.splitlines():
        m = re.match(r"\| (\d+\.\d+\.\d+) \|", line)
        if m:
            kept[m.group(1)] = line
    new = _table(results, pytest_args).splitlines()
    rows = {re.match(r"\| (\S+) \|", ln).group(1): ln for ln in new if re.match(r"\| \d", ln)}  # type: ignore[union-attr]
    merged = {**kept, **rows}
    order = sorted(merged, key=lambda v: tuple(int(p) for p in v.split(".")))
    body = [ln for ln in new if not re.match(r"\| \d", ln)]
    at = body.index(END)
    body[at:at] = [merged[v] for v in order]
    DOC.write_text(head + "\n".join(body) + tail)


def main(argv: list[str] | None = None) -> int:
    """Install, run and record each requested torch version; exit 1 if any suite failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS))
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/compatibility.md")
    parser.add_argument("--wheel-dir", help="a folder of already downloaded torch wheels")
    parser.add_argument(
        "--collect", action="store_true", help="write the doc from the last runs' results only"
    )
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = [a for a in pytest_args if a != "--"]
    if args.collect:
        results = [read_results(v) for v in args.versions]
        write_doc(results, pytest_args)
        return 1 if any(r["rc"] != 0 for r in results) else 0
    results = []
    for version in args.versions:
        python, took = install(version, args.wheel_dir)
        print(f"torch {version}: environment {python.parent.parent} ({took:.0f} s to install)")
        if args.install_only:
            continue
        r = run_suite(python, version, pytest_args)
        c = r["counts"]
        print(
            f"torch {version}: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
            f"{c['skipped']} skipped in {r['seconds']:.0f} s (log: {r['log']})",
            flush=True,
        )
        for name, message in r["failures"]:
            print(f"    {name}: {message}")
        results.append(r)
    if results and not args.no_doc:
        write_doc(results, pytest_args)
    return 1 if any(r["rc"] != 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
