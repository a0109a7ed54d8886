#!/bin/sh
# The vllm service's entry in docker-compose.gpus-vllm-states.yml: `vllm serve` with the arguments compose
# passes, then the optional flags that .env sets. A compose list entry whose variable is empty stays an
# empty argument, which vLLM would read as a second model, so flags that may be absent are added here.
#   DRAFTLINE_VLLM_REASONING_PARSER   --reasoning-parser <name>   (empty: not passed)
#   DRAFTLINE_VLLM_TRUST_REMOTE_CODE  true: --trust-remote-code   (empty or false: not passed)
#   DRAFTLINE_VLLM_EXTRA_ARGS         further flags, split on spaces (no value of them may hold a space)
set -eu
set -f  # the extra flags are split on spaces, never expanded as file names
if [ -n "${DRAFTLINE_VLLM_REASONING_PARSER:-}" ]; then
    set -- "$@" --reasoning-parser "$DRAFTLINE_VLLM_REASONING_PARSER"
fi
case "${DRAFTLINE_VLLM_TRUST_REMOTE_CODE:-}" in
    true) set -- "$@" --trust-remote-code ;;
    '' | false) ;;
    *) echo "DRAFTLINE_VLLM_TRUST_REMOTE_CODE is true or false, not '$DRAFTLINE_VLLM_TRUST_REMOTE_CODE'" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086 # one argument per word
set -- "$@" ${DRAFTLINE_VLLM_EXTRA_ARGS:-}
exec vllm serve "$@"
