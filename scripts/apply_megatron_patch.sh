#!/usr/bin/env bash
# Apply patches/megatron_lm_pretrain_gpt.patch to a Megatron-LM checkout (see patches/README.md).
#
#   scripts/apply_megatron_patch.sh [--check | --revert] DIR
#
# DIR must be a Megatron-LM checkout (pretrain_gpt.py and megatron/training/ at its top).
# Checks first (git apply --check), never leaves a half-applied file, and is idempotent: a checkout
# that already carries the patch is reported and left alone (exit 0).
#   --check   only report whether the patch applies, is already applied, or does not apply
#   --revert  take the patch out again
# Exit status: 0 applied / already applied / reverted, 1 the patch does not apply, 2 bad usage or
# DIR is not a Megatron-LM checkout.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH="${SB_PATCH:-$HERE/../patches/megatron_lm_pretrain_gpt.patch}"
MODE=apply

usage() { echo "usage: $0 [--check | --revert] MEGATRON_LM_DIR" >&2; exit 2; }
die() { echo "error: $1" >&2; exit "${2:-2}"; }

DIR=""
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --revert) MODE=revert ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    -*) echo "error: unknown option '$a'" >&2; usage ;;
    *) [[ -z "$DIR" ]] || { echo "error: more than one directory given ('$DIR', '$a')" >&2; usage; }
       DIR="$a" ;;
  esac
done
[[ -n "$DIR" ]] || usage
[[ -f "$PATCH" ]] || die "patch file not found: $PATCH"
[[ -d "$DIR" ]] || die "'$DIR' is not a directory (expected a Megatron-LM checkout)"
DIR="$(cd "$DIR" && pwd)"
if [[ ! -f "$DIR/pretrain_gpt.py" || ! -d "$DIR/megatron/training" ]]; then
  missing=()
  [[ -f "$DIR/pretrain_gpt.py" ]] || missing+=("pretrain_gpt.py")
  [[ -d "$DIR/megatron/training" ]] || missing+=("megatron/training/")
  die "'$DIR' is not a Megatron-LM checkout: no ${missing[*]} at its top (clone https://github.com/NVIDIA/Megatron-LM and pass its root directory)"
fi
command -v git >/dev/null || die "git is required (git apply)"

# Paths in the patch are relative to DIR: keep git from discovering a repository above DIR.
gitapply() { GIT_CEILING_DIRECTORIES="$(dirname "$DIR")" git -C "$DIR" apply "$@" "$PATCH"; }

if gitapply --reverse --check 2>/dev/null; then
  state=applied
elif err="$(gitapply --check 2>&1)"; then
  state=clean
else
  state=conflict
fi

case "$MODE:$state" in
  check:applied) echo "already applied: $DIR/pretrain_gpt.py carries the SparseBalance patch" ;;
  check:clean) echo "applies cleanly to $DIR/pretrain_gpt.py" ;;
  apply:applied) echo "already applied: $DIR/pretrain_gpt.py carries the SparseBalance patch; nothing to do" ;;
  apply:clean)
    gitapply
    echo "applied: $DIR/pretrain_gpt.py now adds the --sparse-balance/--sb-* flags, the SparseBalance"
    echo "layer spec and step hooks. Install the plugin in that environment: pip install -e $(cd "$HERE/.." && pwd)"
    ;;
  revert:applied) gitapply --reverse; echo "reverted: $DIR/pretrain_gpt.py is back to upstream" ;;
  revert:clean) echo "not applied: nothing to revert in $DIR/pretrain_gpt.py" ;;
  *:conflict)
    echo "error: the patch does not apply to $DIR/pretrain_gpt.py:" >&2
    echo "$err" | sed 's/^/  /' >&2
    echo "It was made against the megatron-core 0.19 flow of pretrain_gpt.py's __main__ block" >&2
    echo "(parse_and_validate_args -> gpt_config_from_args -> pretrain_cfg_container_from_args)." >&2
    echo "See patches/README.md for the six calls to make by hand in other versions." >&2
    exit 1 ;;
esac
