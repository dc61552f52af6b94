"""Submitting a search to a Determined cluster: the search-runner experiment and its upload.

The uploaded context is what the search runner sees as its working directory:

    dsat_settings.json   the parsed flags, as JSON
    dsat/                dsat's own package (task images have determined, not dsat)
    <MODEL_DIR name>/    the user's code
    <config name>        the experiment YAML
    <include names>      each --include

Custom searchers exist in Determined up to 0.37; a client or master without them gets a one-line
error naming the versions that work, not an AttributeError deep in a traceback.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsat.constants import ENV_DET_MASTER, RESULTS_ROOT
from dsat.errors import DsatError
from dsat.experiment.config import (
    Experiment,
    entrypoint_script,
    entrypoint_words,
    load_yaml_mapping,
    resolve_context_path,
)
from dsat.experiment.settings import SearchSettings
from dsat.paths import shown
from dsat.runners.determined.configs import (
    DSAT_PACKAGE,
    SEARCH_RUNNER_ENTRYPOINT,
    SETTINGS_UPLOAD,
    search_runner_config,
)
from dsat.runners.local.entrypoint import trial_class
from dsat.trial_failure import first_line

# determined 0.38 removed `determined.searcher` and the master's custom searcher.
FIRST_VERSION_WITHOUT_CUSTOM_SEARCHER = (0, 38)
WORKING_VERSIONS = "determined 0.37 or earlier (pip install 'determined>=0.37,<0.38')"
DSAT_PACKAGE_DIR = Path(__file__).resolve().parents[2]


def version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def has_custom_searcher(version: str) -> bool:
    try:
        return version_tuple(version) < FIRST_VERSION_WITHOUT_CUSTOM_SEARCHER
    except ValueError:
        return True  # a development build: let the master itself say no


def require_client_custom_searcher() -> None:
    """The installed determined package must still ship ``determined.searcher``."""
    import determined

    version = str(getattr(determined, "__version__", "unknown"))
    try:
        from determined import searcher

        searcher.RemoteSearchRunner  # noqa: B018  # the attribute 0.38 removed
    except (ImportError, AttributeError):
        raise DsatError(
            f"the installed determined {version} has no custom searcher (0.38 removed it); "
            f"--runner determined needs {WORKING_VERSIONS}, or use --runner local"
        ) from None


def require_master_custom_searcher(master_url: str, master_version: str) -> None:
    if not has_custom_searcher(master_version):
        raise DsatError(
            f"the Determined master at {master_url} runs {master_version}, which has no custom "
            f"searcher; --runner determined needs a master running {WORKING_VERSIONS.split(' (')[0]}"
            ", or use --runner local"
        )


def upload_names(experiment: Experiment) -> dict[str, Path]:
    """Name at the top of the uploaded context -> local path; names must not collide."""
    names: dict[str, Path] = {
        SETTINGS_UPLOAD: Path(SETTINGS_UPLOAD),
        DSAT_PACKAGE: DSAT_PACKAGE_DIR,
    }
    for path in (experiment.model_dir, experiment.config_path, *experiment.includes):
        name = path.resolve().name
        if name in names and names[name] != path.resolve():
            raise DsatError(
                f"{path}: uploads as '{name}', which is already taken in the search runner's "
                "context (by dsat or another path); rename it or move it into MODEL_DIR"
            )
        names[name] = path.resolve()
    # The trials' experiment has MODEL_DIR's contents at its top, and dsat's package and each
    # include beside them by name: a clash there was the master's "duplicate path" in the search
    # runner, restarted to fail alike (a clone of dsat in the project, an include copied in).
    for name in (DSAT_PACKAGE, *(path.resolve().name for path in experiment.includes)):
        clash = experiment.model_dir / name
        if clash.exists() or clash.is_symlink():
            raise DsatError(
                f"{clash}: each trial's context takes "
                f"{'dsat itself' if name == DSAT_PACKAGE else 'that --include'} under the name "
                f"'{name}' beside MODEL_DIR's files; rename or move one of the two"
            )
    return names


def stage_context(settings: SearchSettings, experiment: Experiment, staging: Path) -> list[Path]:
    """Write the settings and dsat's package into ``staging``; returns the includes to upload."""
    names = upload_names(experiment)
    (staging / SETTINGS_UPLOAD).write_text(settings.to_json() + "\n")
    shutil.copytree(
        DSAT_PACKAGE_DIR,
        staging / DSAT_PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    return [path for name, path in names.items() if name not in (SETTINGS_UPLOAD, DSAT_PACKAGE)]


def runner_config(settings: SearchSettings, experiment: Experiment) -> dict[str, Any]:
    if settings.search_runner_config is not None:
        path = settings.search_runner_config
        config = load_yaml_mapping(Path(path))
        config.setdefault("entrypoint", SEARCH_RUNNER_ENTRYPOINT)
        restarts = settings.max_search_runner_restarts
        if restarts is not None:  # given: taken, not dropped unsaid
            if config.setdefault("max_restarts", restarts) != restarts:
                raise DsatError(
                    f"--max-search-runner-restarts {restarts} and max_restarts "
                    f"{config['max_restarts']} in {path} disagree; drop one"
                )
        return config
    return search_runner_config(experiment.config, settings, experiment.config_path.stem)


def experiment_url(master_url: str, experiment_id: int) -> str:
    return f"{master_url.rstrip('/')}/det/experiments/{experiment_id}"


def earlier_results_uploaded(model_dir: Path, ignored: Any) -> str:
    """What to say where local searches left their results in MODEL_DIR (the default from
    ``python3 -m dsat guided deepspeed.yaml .``) and its .detignore (``ignored``, as
    Determined's client reads it) does not leave them out: Determined uploads them with it, to
    the search runner and to every trial, and a local trial's copies and a full run's
    checkpoints soon pass its upload limit."""
    folder = model_dir / RESULTS_ROOT
    if not folder.is_dir() or ignored.match_file(f"{RESULTS_ROOT}/"):
        return ""
    return (
        f"{folder} (earlier local searches' results) is uploaded with MODEL_DIR, to the search "
        f"runner and to every trial; add a line {RESULTS_ROOT}/ to {model_dir / '.detignore'}"
    )


def what_the_upload_loses(experiment: Experiment, spec: Any) -> tuple[list[str], list[str]]:
    """What Determined's client would not take of MODEL_DIR as the trials need it: the files
    dsat checked that its .detignore (``spec``) leaves out (each an error: the search runner
    failed on the config, or every trial on the script), and the links to folders it uploads
    empty (its walk does not follow them: a note, since the same path may be there on the
    cluster)."""
    model_dir = experiment.model_dir
    needed = [experiment.ds_config_path]
    script = entrypoint_script(experiment.config.get("entrypoint"))
    if script is not None:
        needed.append(model_dir / script)
    dropped = []
    for path in needed:
        with contextlib.suppress(ValueError):  # not in MODEL_DIR: an include, uploaded whole
            relative = path.resolve().relative_to(model_dir.resolve())
            folders = [str(p) + "/" for p in relative.parents if str(p) != "."]
            if any(spec.match_file(name) for name in [str(relative), *folders]):
                dropped.append(str(path))
    linked = sorted(
        str(Path(folder, name))
        for folder, subdirs, _ in os.walk(model_dir)
        for name in subdirs
        if Path(folder, name).is_symlink()
    )
    return dropped, linked


def said_by(err: BaseException) -> str:
    """What the master said, in one line: its gateway's JSON body carries it as "message";
    else the first line of what its client raised, or the error's kind where it said nothing."""
    text = str(err).strip()
    with contextlib.suppress(ValueError, AttributeError):
        text = json.loads(text).get("message") or text
    return first_line(text) or type(err).__name__


def submit(settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]) -> int:
    """Create the search-runner experiment; prints its id and URL, returns the id."""
    require_client_custom_searcher()
    import requests
    from determined.common import api, detignore
    from determined.common.api import bindings
    from determined.common.api import errors as api_errors
    from determined.experimental import client

    master = environ.get(ENV_DET_MASTER) or None
    if master is not None:
        try:
            api.canonicalize_master_url(master)
        except ValueError as err:  # Python's traceback, after "runner determined" was said
            raise DsatError(
                f"{ENV_DET_MASTER}={master!r} is not a master's address ({err}); give "
                "HOST:PORT or http(s)://HOST:PORT"
            ) from None
    try:
        determined = client.Determined(master=master)
        master_url = determined._session.master
        info = bindings.get_GetMaster(determined._session)
        require_master_custom_searcher(master_url, info.version)
        config = runner_config(settings, experiment)
        ignored = detignore._build_detignore_pathspec(experiment.model_dir)
        uploaded_results = earlier_results_uploaded(experiment.model_dir, ignored)
        if uploaded_results:
            print(f"dsat: note: {uploaded_results}")
        dropped, linked = what_the_upload_loses(experiment, ignored)
        if dropped:
            raise DsatError(
                f"{dropped[0]}: {experiment.model_dir / '.detignore'} leaves it out of what "
                "Determined uploads, and the trials need it; take it out of .detignore"
            )
        for folder in linked:
            print(
                f"dsat: note: {folder} links to a folder, which Determined uploads empty (its "
                "client does not follow links): the trials find it so unless the cluster mounts "
                "it there; copy its files in, or read them from where the cluster has them"
            )
        with tempfile.TemporaryDirectory(prefix="dsat-upload-") as staging:
            includes = stage_context(settings, experiment, Path(staging))
            try:
                created = determined.create_experiment(config, staging, includes)
            except ValueError as err:  # Determined's own check of the upload's size
                if "maximum allowed size" not in str(err):
                    raise
                raise DsatError(
                    f"{experiment.model_dir}: MODEL_DIR, the config and the includes come to more "
                    "than Determined uploads; list what trials do not need (data, checkpoints"
                    f"{', ' + RESULTS_ROOT + '/' if uploaded_results else ''}) in a .detignore "
                    "file in MODEL_DIR"
                ) from None
    except api_errors.MasterNotFoundException:
        raise DsatError(
            f"no Determined master answers at {master or 'the default address'}; check "
            f"{ENV_DET_MASTER}, or use --runner local"
        ) from None
    except api_errors.UnauthenticatedException:
        raise DsatError(
            "the Determined master refused the login; run `det user login` or set DET_USER and "
            "DET_PASS"
        ) from None
    except api_errors.ForbiddenException as err:
        raise DsatError(
            f"the Determined master refused: {said_by(err)}; check the user's permissions on "
            "the config's workspace and project"
        ) from None
    except (api_errors.BadRequestException, api_errors.BadResponseException) as err:
        # Every other refusal and failed request (APIException is one), a timeout included.
        status = getattr(err, "status_code", None)
        if isinstance(status, int) and status >= 500:  # the master's trouble, not the config's
            raise DsatError(
                f"the Determined master could not take the search runner now (HTTP {status}: "
                f"{said_by(err)}); try again, or ask its administrator if it goes on"
            ) from None
        raise DsatError(
            f"the Determined master rejected the search runner: {said_by(err)}"
        ) from None
    except (api_errors.CorruptTokenCacheException, api_errors.CorruptCertificateCacheException):
        raise DsatError("Determined's saved login is damaged; run `det user login` again") from None
    except requests.exceptions.SSLError as err:
        raise DsatError(
            f"cannot talk to the Determined master over TLS ({said_by(err)}); set DET_MASTER_CERT_FILE "
            "to the master's certificate, or check the address's scheme"
        ) from None
    print(f"Created experiment {created.id}")
    print(f"dsat: follow the search at {experiment_url(master_url, created.id)}")
    return int(created.id)


def check_trial_class(experiment: Experiment) -> None:
    """``DsatError`` where the entrypoint's Trial class (``model_def:MyTrial``) is not in the
    module of MODEL_DIR it names: every trial failed on the cluster with an ImportError. A module
    MODEL_DIR does not hold may be the image's, and is left to the cluster."""
    name = trial_class(entrypoint_words(experiment.config.get("entrypoint")))
    if name is None or ":" not in name:
        return
    module, _, class_name = name.partition(":")
    relative = Path(*module.split("."))
    found = [
        path
        for candidate in (relative.with_suffix(".py"), relative / "__init__.py")
        if (path := resolve_context_path(str(candidate), experiment.model_dir, experiment.includes))
    ]
    if not found:
        return
    try:
        tree = ast.parse(found[0].read_bytes(), str(found[0]))
    except (SyntaxError, ValueError) as err:
        raise DsatError(
            f"{shown(found[0])}: the Trial class's module does not parse ({err})"
        ) from None
    bound = module_names(tree)
    if bound is not None and class_name not in bound:
        raise DsatError(
            f"{experiment.config_path}: the entrypoint names the Trial class {name}, and "
            f"{shown(found[0])} defines no {class_name}; fix the name"
        )


def module_names(tree: ast.Module) -> set[str] | None:
    """The names a module binds at its top level (classes, functions, imports, assignments);
    None where a star import may bind any."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            return None  # bound conditionally: not worth guessing
    return names


@dataclasses.dataclass(frozen=True)
class DeterminedSetup:
    """The whole search runs on the cluster, so there is no trial runner here: only the submit."""

    settings: SearchSettings
    experiment: Experiment
    environ: Mapping[str, str]

    @classmethod
    def prepare(
        cls, settings: SearchSettings, experiment: Experiment, environ: Mapping[str, str]
    ) -> DeterminedSetup:
        if settings.resume or settings.results_dir:
            flag = "--resume" if settings.resume else "--results-dir"
            raise DsatError(
                f"{flag} applies to the local, Ray and simulated runners; on Determined the results "
                "live in the search runner's checkpoints and a restarted search runner resumes by "
                "itself"
            )
        # Accepted and ignored, these would leave the user trusting what does not happen there.
        if settings.trial_timeout is not None:
            raise DsatError(
                "--trial-timeout applies to the local and Ray runners; on Determined set the "
                "trials' limits in the experiment config (a hung trial can be killed there)"
            )
        for flag, given in (
            ("--fresh-processes", settings.fresh_processes),
            (
                "--trial-host" if settings.trial_host else "--no-trial-host",
                settings.trial_host is not None,
            ),
        ):
            if given:
                raise DsatError(
                    f"{flag} applies to the local runner; on Determined each trial is its own "
                    "task: drop it"
                )
        check_trial_class(experiment)
        return cls(settings, experiment, environ)

    def submit(self) -> int:
        return submit(self.settings, self.experiment, self.environ)
