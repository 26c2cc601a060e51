"""tests/deploy runs only through tests/deploy/run.sh (`make test-deploy`), which prepares
dockerd, the local images and the wheelhouse first and sets REIN_DEPLOY_TEST=1; a plain
`pytest` (`make test`) collects nothing here."""

import os

if os.environ.get("REIN_DEPLOY_TEST") != "1":
    collect_ignore_glob = ["test_*.py"]
