"""How `make test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadfile`, Makefile), used by
the hooks in tests/conftest.py.

* A test file is one unit of work, run whole by one worker, so a module-scoped export or server is built
  once, as in a serial run. The Docker files are one unit together (DOCKER_FILES): they share one engine
  and build the same image tags, which two workers would build at once.
* The longest files are handed out first (LONGEST_FIRST, from a full run's --durations), so that no
  worker is left alone at the end with a long file while the other has finished.
* Each worker runs PyTorch on one thread (WORKER_THREADS): with two workers on two cores, PyTorch's own
  thread per core made two workers slower than one (a file that exports 11 models went from 43 s to 181 s
  of setup); on one thread each, the two workers' files take what they take alone.
"""

from __future__ import annotations

import os
import sys

# One unit: the files that drive the Docker engine (tests/docker_env.py).
DOCKER_FILES = ("tests/test_deploy_doc_commands.py", "tests/test_deploy_gpu_image.py", "tests/test_deploy_lb.py",
                "tests/test_docker_smoke.py")
DOCKER_UNIT = "docker-engine"

# Files of 15 s or more, longest first (the Docker unit first: on a machine without the images its
# builds take minutes, mostly downloads, which the other worker's exports overlap). Any other file
# comes after these, in collection order.
LONGEST_FIRST = (
    "test_deploy_lb.py", "test_docker_smoke.py",
    "test_long_attention.py", "test_parity.py", "test_rotary_encoder_families.py", "test_model_ids.py",
    "test_llama_mistral_families.py", "test_decoder_families.py", "test_distil_electra_families.py",
    "test_deberta_family.py", "test_hf_families.py", "test_mpnet.py",
    "test_heads.py", "test_big_graph.py", "test_tiled_attention.py", "test_tiled_serving.py",
    "test_external_data.py", "test_graph_variants.py", "test_modernbert_serving.py", "test_task_routes.py",
    "test_st_dense.py", "test_export_cli.py", "test_text_serving.py", "test_http_connections.py",
)

WORKER_THREADS = "1"


def in_worker_of_several() -> bool:
    """True in an xdist worker when there is more than one."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def limit_threads() -> None:
    """One PyTorch (OpenMP) thread in this worker and in the processes it starts (export CLIs); an explicit
    OMP_NUM_THREADS is kept."""
    os.environ.setdefault("OMP_NUM_THREADS", WORKER_THREADS)
    if "torch" in sys.modules:  # imported before this ran: set it there too
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def longest_first(items: list) -> None:
    """Sorts the collected items (stable) so the files of LONGEST_FIRST come first, in that order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def make_scheduler(config, log):
    """`--dist loadfile` with the Docker files as one unit, units handed out in collection order (which
    longest_first set in the workers) rather than by their number of tests."""
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return DOCKER_UNIT if path in DOCKER_FILES else path

    config.option.loadscopereorder = False
    return Scheduling(config, log)
