#!/usr/bin/env bash
# Instruction histogram of one kernel's SASS: bash tools/sass_hist.sh <.so> <kernel-name-regex>
so=$1; pat=$2
cuobjdump --dump-sass "$so" | awk -v pat="$pat" '/Function :/ {on = ($0 ~ pat)} on' \
  | grep -oE "^\s+/\*[0-9a-f]{4,5}\*/\s+(@!?U?P[0-9T] )?[A-Z][A-Z0-9_]*" | awk '{print $NF}' | sort | uniq -c | sort -rn | head -30
