#!/bin/bash
# Runs scripts/gpu_session.sh on the device from a committed tree instead of the working tree
# that the device tool copies (where someone's half-done edits may be): here first
#   git archive HEAD -o .whl/tree.tar
# then run(command="PART=check bash scripts/gpu_from_tree.sh", carry=[".whl"]). The tree has
# no .git: benchmarks that compare with another commit take that commit's files from .whl/.
set -e
here=$PWD
rm -rf /tmp/tree && mkdir -p /tmp/tree
tar -xf .whl/tree.tar -C /tmp/tree
ln -s "$here/.whl" /tmp/tree/.whl
cd /tmp/tree
echo "tree: $(tar -tf "$here/.whl/tree.tar" | wc -l) files from .whl/tree.tar"
exec bash scripts/gpu_session.sh
