"""The node daemon: assembles the layers and runs them in one trio nursery."""

from ._options import NodeConfig as NodeConfig
from ._options import build_config as build_config
from ._options import options_help as options_help
from ._options import parse_options as parse_options
from ._paths import control_socket as control_socket
from ._paths import default_state_dir as default_state_dir
from ._run import run_node as run_node
