#!/bin/sh
# The redis service's entry: redis-server with the arguments compose passes, REDIS_PASSWORD as the default
# user's password, and one ACL user per role of roles.acl whose password variable is set (README,
# "Security"). No role password set: no user is added, and every service uses the default user as before.
# Passwords stay in the environment and the server's arguments; nothing writes them to a file.
set -eu
set -f  # the rules hold ~* and &*: never expand them as file names
roles="$(dirname "$0")/roles.acl"
: "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
set -- "$@" --requirepass "$REDIS_PASSWORD"
while read -r role variable rules; do
    case "$role" in '' | '#'*) continue ;; esac
    eval "password=\${$variable:-}"
    [ -n "$password" ] || continue
    case "$password" in
        *[!A-Za-z0-9._~-]*) echo "$variable may hold only letters, digits and -._~ (it travels inside REDIS_URL)" >&2; exit 2 ;;
    esac
    # shellcheck disable=SC2086 # one argument per rule
    set -- "$@" --user "$role" reset on ">$password" $rules
done < "$roles"
exec redis-server "$@"
