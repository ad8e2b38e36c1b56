"""``python bench/queue.py [--quick] [--plot] ...``: the fair create queue under four trainers.
The bench itself is ``bench/fair_queue.py`` (its docstring says what it measures); this file
only runs it.

A file named ``queue.py`` in this folder shadows the standard library's ``queue`` for every
bench here (a script's folder comes first on ``sys.path``, and ``concurrent.futures`` and
``multiprocessing`` import ``queue``). So imported under that name, this file loads the
standard library's module in its own place: the import system hands back what
``sys.modules`` holds once the file has run.
"""

import sys

if __name__ == "__main__":
    from fair_queue import main

    main()
elif __name__ == "queue":
    import importlib.util
    import sysconfig
    from pathlib import Path

    _spec = importlib.util.spec_from_file_location(
        "queue", Path(sysconfig.get_path("stdlib")) / "queue.py"
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules["queue"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["queue"])
