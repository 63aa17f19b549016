"""Write pvegpu's launcher for a venv: what the .deb installs as /opt/pvegpu/bin/pvegpu (and /usr/bin/pvegpu links to).

    VENV/bin/python3 packaging/launcher.py VENV/bin/pvegpu [--path DIR]... [--ignore-pth]

pip's console script runs the interpreter with the full ``site`` (the venv's site-packages found through
``pyvenv.cfg``, every ``.pth`` file run, ``sitecustomize``) and then ``import re``. The launcher runs the same
interpreter isolated and without ``site`` (``-IS``: no PYTHON* variables, no user site, no ``.pth`` scan) and puts
the venv's site-packages on ``sys.path`` itself, after the standard library as ``site`` would; ``argv[0]``, the exit
codes and every command stay what they are. Without ``site`` a ``.pth`` file would not run: the launcher refuses to
be written for a directory that has one (``--ignore-pth``: the caller knows they are not needed, e.g. a checkout
put first with ``--path`` beside an editable install). ``--path`` (repeatable) puts a directory before this
interpreter's site directories (``site.getsitepackages()``, those that exist). Python 3 standard library only;
exit 2 with one line on a problem.
"""

from __future__ import annotations

import os
import site
import sys

TEMPLATE = """#!{python} -IS
# pvegpu's launcher (packaging/launcher.py): the venv's interpreter isolated and without site (-IS: no .pth scan,
# no sitecustomize, no PYTHON* variables), its site-packages named here, after the standard library as site puts them.
import sys
sys.path.extend({paths!r})
from pvegpu.__main__ import main
main()
"""


def launcher_text(python: str, paths: list[str]) -> str:
    return TEMPLATE.format(python=python, paths=paths)


def main(argv: list[str]) -> int:
    out, paths, ignore_pth = "", [], False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--path" and i + 1 < len(argv):
            paths.append(os.path.abspath(argv[i + 1]))
            i += 2
            continue
        if a == "--ignore-pth":
            ignore_pth = True
        elif a.startswith("-") or out:
            return _die(f"unexpected argument {a!r} (usage: launcher.py OUT [--path DIR]... [--ignore-pth])")
        else:
            out = a
        i += 1
    if not out:
        return _die("usage: launcher.py OUT [--path DIR]... [--ignore-pth]")
    site_dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    paths = list(dict.fromkeys(paths + site_dirs))
    python = os.path.abspath(sys.executable)  # the venv's bin/python3 (not resolved: it is the venv's interpreter)
    if any(c.isspace() for c in python) or len(python) > 120:
        return _die(f"interpreter path {python!r} cannot be a #! line")
    if not any(os.path.isfile(os.path.join(d, "pvegpu", "__main__.py")) for d in paths):
        return _die(f"no pvegpu package in {', '.join(paths)}")
    for d in site_dirs:
        pth = sorted(f for f in (os.listdir(d) if os.path.isdir(d) else ()) if f.endswith(".pth"))
        if pth and not ignore_pth:
            return _die(f"{d} has .pth files the launcher would skip: {', '.join(pth)}")
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(launcher_text(python, paths))
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return 0


def _die(msg: str) -> int:
    print(f"launcher.py: {msg}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
