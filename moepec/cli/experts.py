"""`moepec experts MODULE:FACTORY`: what expert discovery finds in a model, before a run.

The factory is imported and called with no arguments; it returns the model (an
``nn.Module``), built as the training script builds it (on the meta device is fine: only
names and shapes are read). The command prints the MoE layers found, what was looked at
and refused, and a ready ``moepec.ExpertSpec(...)`` when something may have been missed.
Exit code 0 when experts were found, 1 when none, 2 for a usage error.

``commands()`` returns the subcommand for ``moepec.cli.main`` to register.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys

from torch import nn

from moepec.errors import ConfigError
from moepec.state.experts import ExpertSpec, describe, discover


def load_model(target: str) -> nn.Module:
    """Build the model named by ``MODULE:FACTORY`` (or ``path/to/file.py:FACTORY``).

    Runs the user's code (it is their model); raises ConfigError naming the fix when the
    module, the factory or its result is not usable."""
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise ConfigError(f"{target!r} is not MODULE:FACTORY; e.g. `moepec experts "
                          f"mypkg.model:build` or `moepec experts train.py:make_model`")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ConfigError(f"no file {module_name}; give the path of the script that "
                              f"defines {factory_name}")
        spec = importlib.util.spec_from_file_location("_moepec_user_model", module_name)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        with _your_code(f"{module_name} failed to load"):
            spec.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ConfigError(f"cannot import {module_name!r} ({exc}); run from the directory "
                              f"that holds it or install it") from None
        except Exception as exc:  # noqa: BLE001 - the user's module: its error, one line
            raise _their_error(f"{module_name} failed to load", exc) from exc
    factory = module
    for part in factory_name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"{module_name} has no {factory_name!r}; name a function or "
                              f"class that builds the model")
    if not callable(factory):
        raise ConfigError(f"{target} is not callable; name a function or class that "
                          f"builds the model with no arguments")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise ConfigError(f"{target} needs arguments; name a function or class that builds "
                          f"the model with no arguments (wrap yours in one)") from None
    except ValueError:
        pass  # no signature to read (a builtin): call it and see
    with _your_code(f"{target}() failed"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{target}() returned a {type(model).__name__}, not a torch "
                          f"nn.Module; return the model")
    return model


def _their_error(what: str, exc: BaseException) -> ConfigError:
    where = ""
    if isinstance(exc, SyntaxError):
        where = f" ({exc.filename}, line {exc.lineno})"
    return ConfigError(f"{what}: {type(exc).__name__}: {exc}{where}; the error is in your "
                       f"code, not moepec's (run it alone to see the traceback)")


@contextlib.contextmanager
def _your_code(what: str):
    """Any error of the user's code, as one line that says whose it is."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: any error it raises
        raise _their_error(what, exc) from exc


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="module (or file.py) and a function or class building the model "
                        "with no arguments, e.g. mypkg.model:build")
    p.add_argument("--stacked", default=None, metavar="REGEX",
                   help="ExpertSpec.stacked: match stacked [E, ...] experts by name")
    p.add_argument("--modules", default=None, metavar="REGEX",
                   help="ExpertSpec.modules: match per-expert module parameters by name")
    p.add_argument("--ragged", action="store_true",
                   help="ExpertSpec.ragged: stacked tensors may fuse extra experts after "
                        "the routed ones (LongcatFlash)")


def _run(args: argparse.Namespace) -> int:
    spec = ExpertSpec(stacked=args.stacked, modules=args.modules, ragged=args.ragged)
    model = load_model(args.target)
    params = dict(model.named_parameters())
    emap = discover(model, spec)
    print(describe(emap, params, limit=1000))
    n_expert = sum(params[n].numel() for n in emap.owner)
    n_all = sum(p.numel() for p in params.values())
    print(f"expert parameters: {n_expert:,} of {n_all:,} ({100 * n_expert / max(n_all, 1):.1f}%)"
          f"; non-expert tensors: {len(emap.non_expert)} (saved at every checkpoint)")
    return 0 if emap.layers else 1


def commands():
    """(name, help, add_arguments, run) of the subcommand here."""
    return [("experts", "show which parameters expert discovery takes as experts (check a "
                        "model before a long run)", _add_arguments, _run)]
