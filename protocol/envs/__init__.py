"""A run's own environment: a researcher's tasks and reward code, pinned and verified like the built-in ones.

One shape (``docs/tasks.md`` § Your own environment): an environment says **where its tasks come
from** (a data file, or a generator with a seed; its held-out tasks from its own split or a
disjoint seed range), **how a prompt is built** from a task, and **how a completion is scored**
(a number in [0, 1]). Three adapters give that shape to what researchers already have:
reasoning-gym datasets by name (with weights), prime ``verifiers`` single-turn environments, and
a plain Python file with ``score(task, completion)``. The run spec's ``[env]`` names the
environment and pins it by content hash; every node runs its code in the bubblewrap sandbox.

What lives where:

* ``ref``        — :func:`parse_env_ref` (``env.name`` → :class:`EnvRef`), :class:`EnvError`, :func:`install_hint` (pure).
* ``pin``        — :func:`environment_hash`, :func:`check_environment_hash`, :class:`EnvFile`: the one content hash (pure).
* ``tasks``      — an environment's rows as tasks of type ``environment``; held-out rules (pure).
* ``files``      — :func:`environment_source`: its files and package versions on this machine (**reads files**).
* ``sandboxed``  — :func:`open_environment`, :class:`Environment`: its code in persistent sandboxes
  fed over a pipe, per-call bounds (**starts processes**; the harness inside is ``_env_child.py``).
"""

from protocol.envs.files import EnvSource, environment_source
from protocol.envs.pin import EnvFile, check_environment_hash, environment_hash
from protocol.envs.ref import ENV_EXTRAS, EnvError, EnvRef, install_hint, parse_env_ref
from protocol.envs.sandboxed import Environment, EnvLimits, EnvScore, environment_for, open_environment
from protocol.envs.tasks import HELDOUT_SEED_OFFSET, row_answer

__all__ = [
    "ENV_EXTRAS",
    "HELDOUT_SEED_OFFSET",
    "EnvError",
    "EnvFile",
    "EnvLimits",
    "EnvRef",
    "EnvScore",
    "EnvSource",
    "Environment",
    "check_environment_hash",
    "environment_for",
    "environment_hash",
    "environment_source",
    "install_hint",
    "open_environment",
    "parse_env_ref",
    "row_answer",
]
