"""CORE's eval bundle: the pinned archive (read directly, never unpacked) or a local folder
(unofficial), its tasks (core.yaml, with the random baselines of eval_meta_data.csv) and each
task's examples."""
from __future__ import annotations

import csv
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.common import CoreError, atomic_write_bytes, log, sha256_file
from harness.config import cache_root
from harness.download import download_file

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# The bundle's SHA-256, once the organisers publish it. Set it here or in $FRONTIER_EVAL_BUNDLE_SHA256:
# every run then checks the archive against it, and only a run on the pinned archive is official.
EVAL_BUNDLE_SHA256 = ""
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
REQUIRED_FIELDS = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
                   "language_modeling": ("context", "continuation")}


@dataclass
class Task:
    label: str
    task_type: str
    num_fewshot: int
    delimiter: str
    dataset_uri: str
    random_baseline: float  # percent


@dataclass
class Bundle:
    source: str  # the archive or folder it was read from
    sha256: str | None  # of the archive; None for a folder
    pinned: bool  # the archive's SHA-256 equals a configured pin
    files: dict = field(repr=False, default_factory=dict)  # relative path -> bytes, read once at load time

    def read_text(self, relative: str) -> str:
        if relative not in self.files:
            raise CoreError(f"the CORE bundle ({self.source}) has no {relative}")
        return self.files[relative].decode("utf-8")


def bundle_from_dir(path: Path) -> Bundle:
    """A local bundle folder (path itself or its eval_bundle/ subfolder), read into memory."""
    path = Path(path).expanduser()
    for root in (path, path / "eval_bundle"):
        if (root / "core.yaml").is_file():
            files = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
            return Bundle(str(root), None, False, files)
    raise CoreError(f"no CORE bundle at {path} (core.yaml not found). Omit --bundle-dir to download it, or unzip "
                    "eval_bundle.zip there.")


def _zip_root(names: list[str]) -> str | None:
    """The folder prefix of core.yaml inside the archive ('' or 'eval_bundle/'), None if absent."""
    for name in sorted(names, key=len):
        if name == "core.yaml" or name.endswith("/core.yaml"):
            return name[:-len("core.yaml")]
    return None


def _check_zip(path: Path) -> None:
    if not zipfile.is_zipfile(path):
        raise CoreError(f"{path.name} is not a zip archive")
    with zipfile.ZipFile(path) as z:
        if _zip_root(z.namelist()) is None:
            raise CoreError(f"{path.name} holds no core.yaml")


def bundle_from_zip(path: Path, pinned: bool, sha256: str) -> Bundle:
    with zipfile.ZipFile(path) as z:
        root = _zip_root(z.namelist())
        files = {n[len(root):]: z.read(n) for n in z.namelist() if n.startswith(root) and not n.endswith("/")}
    return Bundle(str(path), sha256, pinned, files)


def configured_pin(sha256: str | None = None) -> str:
    return (sha256 if sha256 is not None else os.environ.get("FRONTIER_EVAL_BUNDLE_SHA256") or EVAL_BUNDLE_SHA256).lower()


def ensure_bundle(bundle_dir=None, url: str | None = None, sha256: str | None = None) -> Bundle:
    """The eval bundle. --bundle-dir: that folder, as is (unofficial). Otherwise the archive in the
    cache, downloaded on first use (its SHA-256 is recorded beside it and printed), checked against
    the configured pin when there is one, and read straight from the archive."""
    if bundle_dir is not None:
        return bundle_from_dir(Path(bundle_dir))
    url = url or os.environ.get("FRONTIER_EVAL_BUNDLE_URL") or EVAL_BUNDLE_URL
    pin = configured_pin(sha256)
    archive = cache_root() / "eval_bundle.zip"
    record = cache_root() / "eval_bundle.zip.sha256"
    if archive.exists():
        try:
            _check_zip(archive)
        except CoreError as e:
            log(f"[core] replacing a bad archive: {e}")
            archive.unlink()
    if not archive.exists():
        log(f"[core] downloading the eval bundle from {url}")
        download_file(url, archive, validate=_check_zip)
        digest = sha256_file(archive)
        atomic_write_bytes(record, f"{digest}  eval_bundle.zip\n".encode())
        log(f"[core] eval_bundle.zip sha256 {digest} (recorded in {record})")
    actual = sha256_file(archive)
    if pin and actual != pin:
        raise CoreError(f"{archive} has sha256 {actual}, but the pinned bundle is {pin}. Delete it and rerun to "
                        "download it again; if it persists, the published bundle changed.")
    if not pin and record.exists() and record.read_text().split()[0] != actual:
        raise CoreError(f"{archive} changed since it was downloaded (sha256 {actual}, recorded "
                        f"{record.read_text().split()[0]} in {record}). Delete both and rerun to download it again.")
    return bundle_from_zip(archive, bool(pin), actual)


def load_tasks(bundle: Bundle) -> list[Task]:
    """The tasks of core.yaml with their random baselines from eval_meta_data.csv."""
    import yaml
    try:
        config = yaml.safe_load(bundle.read_text("core.yaml"))
        entries = config["icl_tasks"]
    except CoreError:
        raise
    except Exception as e:
        raise CoreError(f"{bundle.source}: core.yaml is not a CORE task list ({type(e).__name__}: {e})")
    baselines = {}
    try:
        for row in csv.DictReader(io.StringIO(bundle.read_text("eval_meta_data.csv"))):
            baselines[row["Eval Task"]] = float(row["Random baseline"])
    except (KeyError, ValueError) as e:
        raise CoreError(f"{bundle.source}: eval_meta_data.csv: cannot read the random baselines "
                        f"({type(e).__name__}: {e})")
    tasks = []
    for entry in entries:
        label = entry.get("label", "?")
        if entry.get("icl_task_type") not in TASK_TYPES:
            raise CoreError(f"core.yaml: task {label!r} has icl_task_type {entry.get('icl_task_type')!r}; known types: "
                            f"{', '.join(TASK_TYPES)}")
        if label not in baselines:
            raise CoreError(f"eval_meta_data.csv has no random baseline for task {label!r}")
        tasks.append(Task(label, entry["icl_task_type"], int(entry["num_fewshot"][0]),
                          entry.get("continuation_delimiter", " "), entry["dataset_uri"], baselines[label]))
    return tasks


def load_examples(bundle: Bundle, task: Task) -> list[dict]:
    relative = f"eval_data/{task.dataset_uri}"
    if relative not in bundle.files:
        raise CoreError(f"task {task.label!r}: data file {relative} is missing from {bundle.source}")
    examples = []
    for n, line in enumerate(bundle.read_text(relative).splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line.strip())
        except json.JSONDecodeError as e:
            raise CoreError(f"{relative}:{n}: not valid JSON ({e})")
        missing = [k for k in REQUIRED_FIELDS[task.task_type] if not isinstance(item, dict) or k not in item]
        if missing:
            raise CoreError(f"{relative}:{n}: a {task.task_type} example needs {list(REQUIRED_FIELDS[task.task_type])}; "
                            f"missing {missing}")
        examples.append(item)
    return examples
