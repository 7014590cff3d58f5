"""`python -m ortrain.mlflow replay FILE [--tracking-uri URI]`: re-sends the metrics (and run
ends) that ortrain spilled to a JSONL file while the MLflow server was unreachable. On success
the file is renamed to FILE.replayed so that a second replay cannot duplicate points."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ortrain.mlflow", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay", help="re-send a spill file")
    r.add_argument("file")
    r.add_argument("--tracking-uri", default=None,
                   help="MLflow server (default: $ORTRAIN_TRACKING_URI or $MLFLOW_TRACKING_URI)")
    r.add_argument("--keep", action="store_true", help="do not rename the file after a successful replay")
    args = p.parse_args(argv)

    uri = args.tracking_uri or os.environ.get("ORTRAIN_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        print("error: give --tracking-uri (the server the run was logged to) or set MLFLOW_TRACKING_URI",
              file=sys.stderr)
        return 2
    from ortrain._ortrain import MlflowClient

    try:
        stats = MlflowClient(uri).replay(args.file)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: replay of {args.file} failed: {e}", file=sys.stderr)
        return 1
    if not args.keep:
        os.replace(args.file, args.file + ".replayed")
    print(f"replayed {stats['metrics']} metrics, {stats['params']} params, {stats['tags']} tags "
          f"in {stats['records']} batches; {stats['runs_ended']} runs ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
