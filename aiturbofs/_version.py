"""The package's version, and the ``--version`` flag of its commands.

Read from the installed distribution's metadata when asked, not at import:
``importlib.metadata`` costs ~20 ms, which ``import aiturbofs`` and every
``aiturbo`` command would pay for nothing.
"""

import argparse

DISTRIBUTION = "aiturbofs"
UNKNOWN = "0+unknown"  # a source tree nobody installed: no metadata to read


def version() -> str:
    """The installed distribution's version (PEP 440), or ``0+unknown`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return UNKNOWN


class VersionAction(argparse.Action):
    """``--version``: print ``aiturbofs <version>`` on stdout and exit 0 (argparse's own ``version``
    action wants the string when the parser is built)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{DISTRIBUTION} {version()}")
        parser.exit(0)
