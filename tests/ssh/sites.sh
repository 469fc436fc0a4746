#!/usr/bin/env bash
# Emulated remote sites reachable over SSH, for the launch tests (tests/coordinator_test.cc) and by hand.
#
#   tests/ssh/sites.sh up   DIR PREFIX NET SITE...   # e.g. up /tmp/ssh mt1 10.213.77 a b c
#   tests/ssh/sites.sh down DIR PREFIX SITE...
#
# up: a namespace PREFIX-hub holding a bridge with address NET.1/24 (run the coordinator and `meridian
# launch` there: `ip netns exec PREFIX-hub ...`), and per site a namespace PREFIX-SITE on the bridge with
# address NET.(2+i) in which Debian's sshd runs on port 22 with its own host key. A user key
# (DIR/user_key) is authorised for root at every site; DIR/known_hosts holds every site's host key;
# DIR/SITE.addr its address. Everything stays inside the namespaces made here. Needs root.
# down: stops the sshds and deletes the namespaces.
set -euo pipefail
cmd=$1 dir=$2 prefix=$3
shift 3
if [[ $cmd == down ]]; then
  for s in "$@"; do
    [[ -f $dir/$s/sshd.pid ]] && kill "$(cat "$dir/$s/sshd.pid")" 2>/dev/null || true
    ip netns del "$prefix-$s" 2>/dev/null || true
  done
  ip netns del "$prefix-hub" 2>/dev/null || true
  exit 0
fi
[[ $cmd == up ]] || { echo "usage: $0 up|down DIR PREFIX [NET] SITE..." >&2; exit 2; }
net=$1
shift
mkdir -p "$dir" /run/sshd
chmod 700 "$dir"
[[ -f $dir/user_key ]] || ssh-keygen -q -t ed25519 -N '' -C meridian-test -f "$dir/user_key"
cp "$dir/user_key.pub" "$dir/authorized_keys"
: > "$dir/known_hosts"
ip netns add "$prefix-hub"
ip -n "$prefix-hub" link set lo up
ip -n "$prefix-hub" link add br0 type bridge
ip -n "$prefix-hub" addr add "$net.1/24" dev br0
ip -n "$prefix-hub" link set br0 up
i=2
for s in "$@"; do
  ns=$prefix-$s addr=$net.$i
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add eth0 type veth peer name "v$i" netns "$prefix-hub"
  ip -n "$prefix-hub" link set "v$i" master br0 up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  mkdir -p "$dir/$s"
  ssh-keygen -q -t ed25519 -N '' -C "$s" -f "$dir/$s/host_key"
  cat > "$dir/$s/sshd_config" <<CONF
Port 22
ListenAddress $addr
HostKey $dir/$s/host_key
PidFile $dir/$s/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 50
Subsystem sftp internal-sftp
CONF
  ip netns exec "$ns" /usr/sbin/sshd -f "$dir/$s/sshd_config" -E "$dir/$s/sshd.log"
  echo "$addr $(cat "$dir/$s/host_key.pub")" >> "$dir/known_hosts"
  echo "$addr" > "$dir/$s.addr"
  i=$((i + 1))
done
