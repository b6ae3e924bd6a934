#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0-or-later
# docs.options: the man pages and the bash completion against each command's --help. Every long
# option in the option column of the --help of qcommitd and of each subcommand `qcommit --help`
# lists must be named in the man page (as *--option*, the way the pages set options) and in
# packaging/qcommit.bash-completion (qcommit: the subcommand's list, the options every subcommand
# takes and the subcommand names; qcommitd: its own completion function). The other way round,
# every *--option* of the qcommit page must be an option of some subcommand, every one of the
# qcommitd page's SYNOPSIS and OPTIONS one of qcommitd's, and every option the completion offers a
# subcommand one of that subcommand's; an option a usage synopsis names (qcommit status
# --domain-event, parsed before the option table) counts as one. An option that stands for a
# positional argument (--image for IMAGE, --top for TOP) need not be named; --help is left out.
# The pages must pass scdoc (where installed), the completion bash -n. Prints each gap; exits 1
# when there is one.
# usage: man-completion.sh QCOMMIT QCOMMITD QCOMMIT.1.scd QCOMMITD.8.scd COMPLETION
set -euo pipefail
test_name=docs.options
. "$(dirname "$0")/lib.sh"
QCOMMIT=$1 QCOMMITD=$2 man1=$3 man8=$4 completion=$5

# The long options of a --help text: the first long option of each line of the option column
# ("  --base arg", "  -c [ --connect ] arg"), --help left out.
help_options() {
  sed -nE 's/^  (-[a-zA-Z] \[ )?(--[a-z0-9][a-z0-9-]*).*/\2/p' | { grep -vx -- '--help' || true; } | sort -u
}
# The long options named in a text.
long_options() { { grep -oE -- '--[a-z0-9][a-z0-9-]*' || true; } | sort -u; }
# The usage synopsis of a --help text (from "usage:" to the first empty line).
usage_block() { sed -n '/^usage:/,/^$/p'; }
# The long options a synopsis names.
usage_options() { usage_block | long_options; }
# Whether option $1 stands for a positional argument of synopsis $2: --image for IMAGE.
positional() { grep -qw -- "$(tr 'a-z-' 'A-Z_' <<<"${1#--}")" <<<"$2"; }
# Options a man page (file $1, else stdin) sets in bold: *--name*.
bold_options() { { grep -oE '\*--[a-z0-9][a-z0-9-]*\*' "$@" || true; } | tr -d '*' | sort -u; }
# The options the completion offers for subcommand $1: its `CMD) opts+="..."` line (a line may
# name several commands: "info|map)").
completion_options() {
  sed -nE "s/^ *([a-z|]*\\|)?$1(\\|[a-z|]*)?\\) opts\\+=\"([^\"]*)\".*/\\3/p" "$completion" | long_options
}
# Offered to every subcommand: the `local opts="..."` line.
common_options() { sed -nE 's/^ *local opts="([^"]*)".*/\1/p' "$completion" | long_options; }
# The subcommand names completed after `qcommit`.
completion_commands() { sed -nE 's/.*compgen -W "([a-z ]*)" -- "\$cur".*/\1/p' "$completion" | head -1 | tr ' ' '\n'; }

[[ -s $man1 && -s $man8 && -s $completion ]] || fail "missing input"
# The pages must turn into man pages at all (the package's man target runs scdoc).
if command -v scdoc >/dev/null; then
  for page in "$man1" "$man8"; do
    err=$(scdoc <"$page" 2>&1 >/dev/null) || soft_fail "$(basename "$page"): scdoc refuses it: $err"
  done
fi
bash -n "$completion" || soft_fail "$(basename "$completion"): not valid bash"
commands=$("$QCOMMIT" --help | sed -nE 's/^  ([a-z]+) .*/\1/p' | sort -u)
[[ -n $commands ]] || fail "qcommit --help lists no commands"
all_qcommit=
common=$(common_options)
for cmd in $commands; do
  grep -qx "$cmd" <(completion_commands) || soft_fail "qcommit $cmd: not among the commands the completion offers"
  help=$("$QCOMMIT" "$cmd" --help)
  opts=$(help_options <<<"$help")
  [[ -n $opts ]] || soft_fail "qcommit $cmd --help: no options found"
  synopsis=$(usage_block <<<"$help" | sed -E 's/--[a-z0-9-]+//g')
  all_qcommit+=$'\n'$opts$'\n'$(usage_options <<<"$help")
  offered=$(sort -u <(completion_options "$cmd") <(echo "$common"))
  for o in $opts; do
    positional "$o" "$synopsis" && continue
    grep -qx -- "$o" <(bold_options "$man1") || soft_fail "qcommit $cmd $o: not in the man page ($(basename "$man1"))"
    grep -qx -- "$o" <<<"$offered" || soft_fail "qcommit $cmd $o: not in the completion"
  done
  for o in $(completion_options "$cmd"); do
    grep -qx -- "$o" <<<"$opts" || soft_fail "qcommit $cmd $o: offered by the completion, not an option of $cmd"
  done
  echo "qcommit $cmd: $(wc -w <<<"$opts") long options"
done
for o in $common; do
  [[ $o == --help ]] && continue
  for cmd in $commands; do
    "$QCOMMIT" "$cmd" --help | help_options | grep -qx -- "$o" ||
      soft_fail "qcommit $cmd $o: offered by the completion to every command, not an option of $cmd"
  done
done
for o in $(bold_options "$man1"); do
  [[ $o == --help || $o == --version ]] && continue
  grep -qx -- "$o" <<<"$all_qcommit" || soft_fail "$(basename "$man1") names $o: no qcommit command has it"
done

# qcommitd: its page's SYNOPSIS and OPTIONS entries, and a _qcommitd completion function.
dhelp=$("$QCOMMITD" --help)
dopts=$(help_options <<<"$dhelp")
[[ -n $dopts ]] || soft_fail "qcommitd --help: no options found"
page_dopts=$(awk '/^# /{s=$2} s=="SYNOPSIS"||s=="OPTIONS"' "$man8" | bold_options)
dcompl=$(sed -n '/^_qcommitd()/,/^}/p' "$completion" | long_options)
[[ -n $dcompl ]] || soft_fail "qcommitd: the completion has no _qcommitd function"
for o in $dopts; do
  grep -qx -- "$o" <<<"$page_dopts" || soft_fail "qcommitd $o: not in the man page ($(basename "$man8"), SYNOPSIS or OPTIONS)"
  [[ -z $dcompl ]] || grep -qx -- "$o" <<<"$dcompl" || soft_fail "qcommitd $o: not in the completion"
done
for o in $page_dopts; do
  [[ $o == --help || $o == --version ]] && continue
  grep -qx -- "$o" < <(echo "$dopts"; usage_options <<<"$dhelp") || soft_fail "$(basename "$man8") lists $o: qcommitd has no such option"
done
for o in $dcompl; do
  [[ $o == --help ]] && continue
  grep -qx -- "$o" <<<"$dopts" || soft_fail "qcommitd $o: offered by the completion, not an option of qcommitd"
done
echo "qcommitd: $(wc -w <<<"$dopts") long options"
finish "docs.options: OK"
