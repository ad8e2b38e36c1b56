// The egress allowlists of a node's sandboxes, enforced on each sandbox's cgroup (v2).
//
// Default deny. A destination passes when (protocol, port, address) matches one of the
// sandbox's rules in the longest-prefix-match tries allow4/allow6 (a rule with port 0 matches
// any port), or when it is the sandbox's own loopback. Four hooks enforce it:
//   cgroup/connect4|6   connect() of TCP and UDP sockets (and TCP fast open): EPERM;
//   cgroup/sendmsg4|6   sendto()/sendmsg() with an address on UDP sockets: EPERM;
//   cgroup/sock_create  raw and ICMP sockets are refused outright: they bypass the hooks above;
//   cgroup_skb/egress   every IP packet a socket of the cgroup sends is checked again: a backstop
//                       for whatever reaches the wire without a connect or sendmsg hook, and what
//                       makes a rule removed live cut connections already open.
// A VM's guest runs its own kernel, whose sockets no cgroup hook sees: its packets come out of
// its TAP, across a bridge, and into the egress namespace through the sandbox's veth. There
//   tc (tcx ingress)    guest_egress checks every frame the guest sends on the egress side of
//                       that veth, against the same rules (the `ports` map names the sandbox
//                       by the veth's index); ARP passes, anything else not allowed is dropped.
// Each refusal is counted in the sandbox's `denied` entry (one slot per hook), which the node
// shows per sandbox.
//
// The node loads these programs once and attaches the same ones to every sandbox's cgroup.
// The maps are shared too, and pinned under /sys/fs/bpf/dsec/egress-<source digest>/ so live
// updates and a restarted daemon find them: every key starts with the sandbox's cgroup id, so
// a sandbox matches only its own rules. A cgroup the node did not register, such as a child
// cgroup made inside a sandbox, matches nothing: the programs fail closed. (One map per
// sandbox held in a map of maps would need an RCU grace period, 10-50 ms, per change.)
#include <linux/bpf.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define SOCK_RAW_TYPE 3
#define MAX_RULES (1 << 20)  // all sandboxes' together; the node bounds each one's
#define MAX_SANDBOXES 65536

// Trie keys: prefixlen counts bits from `cgroup` on, so 64 + 32 + the CIDR's length: a key
// matches only within its cgroup. The cgroup id is copied as the CPU holds a __u64; port and
// address are in network byte order, as the kernel hands them over.
struct rule4 {
    __u32 prefixlen;
    __u32 cgroup[2];
    __u8 proto;
    __u8 pad;
    __u16 port;
    __u32 addr;
};

struct rule6 {
    __u32 prefixlen;
    __u32 cgroup[2];
    __u8 proto;
    __u8 pad;
    __u16 port;
    __u32 addr[4];
};

struct {
    __uint(type, BPF_MAP_TYPE_LPM_TRIE);
    __uint(max_entries, MAX_RULES);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, struct rule4);
    __type(value, __u32);
} allow4 SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_LPM_TRIE);
    __uint(max_entries, MAX_RULES);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, struct rule6);
    __type(value, __u32);
} allow6 SEC(".maps");

// Slots of `denied`; dsec_security_ebpf.bpf.COUNTERS names them in this order.
enum {
    DENIED_CONNECT4,
    DENIED_CONNECT6,
    DENIED_SENDMSG4,
    DENIED_SENDMSG6,
    DENIED_SOCKET,
    DENIED_PACKET,
    DENIED_SLOTS,
};

struct counters {
    __u64 n[DENIED_SLOTS];
};

// cgroup id -> the sandbox's refusals
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_SANDBOXES);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, __u64);
    __type(value, struct counters);
} denied SEC(".maps");

// sandbox id (NUL-padded) -> cgroup id: the node's register, read by the node alone
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_SANDBOXES);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, char[32]);
    __type(value, __u64);
} sandboxes SEC(".maps");

// the egress side's index of a VM sandbox's veth (in the egress namespace) -> its cgroup id
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, MAX_SANDBOXES);
    __uint(map_flags, BPF_F_NO_PREALLOC);
    __type(key, __u32);
    __type(value, __u64);
} ports SEC(".maps");

static __always_inline int deny(__u64 cg, __u32 slot)
{
    struct counters *c = bpf_map_lookup_elem(&denied, &cg);

    if (c && slot < DENIED_SLOTS)
        __sync_fetch_and_add(&c->n[slot], 1);
    return 0;
}

// MPTCP is TCP on the wire; its socket reports IPPROTO_MPTCP (262).
static __always_inline __u8 wire_proto(__u32 protocol)
{
    return protocol == 262 ? IPPROTO_TCP : (protocol > 255 ? 255 : protocol);
}

static __always_inline int local4(__u32 addr)
{
    __u32 host = bpf_ntohl(addr);
    // the sandbox's own loopback (it has its own network namespace) and INADDR_ANY, which
    // connect() takes to mean this host
    return (host >> 24) == 127 || host == 0;
}

static __always_inline int allowed4(__u64 cg, __u32 addr, __u16 port, __u8 proto)
{
    struct rule4 key = {.prefixlen = 128, .proto = proto, .port = port, .addr = addr};

    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        return 0;
    __builtin_memcpy(key.cgroup, &cg, sizeof(key.cgroup));
    if (bpf_map_lookup_elem(&allow4, &key))
        return 1;
    key.port = 0;
    return bpf_map_lookup_elem(&allow4, &key) != 0;
}

static __always_inline int mapped4(const __u32 *a)
{
    return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0xffff);
}

static __always_inline int local6(const __u32 *a)
{
    if (a[0] || a[1] || a[2])
        return 0;
    return a[3] == 0 || a[3] == bpf_htonl(1);
}

static __always_inline int allowed6(__u64 cg, const __u32 *a, __u16 port, __u8 proto)
{
    struct rule6 key = {.prefixlen = 224, .proto = proto, .port = port};

    if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
        return 0;
    __builtin_memcpy(key.cgroup, &cg, sizeof(key.cgroup));
    key.addr[0] = a[0];
    key.addr[1] = a[1];
    key.addr[2] = a[2];
    key.addr[3] = a[3];
    if (bpf_map_lookup_elem(&allow6, &key))
        return 1;
    key.port = 0;
    return bpf_map_lookup_elem(&allow6, &key) != 0;
}

static __always_inline int check6(__u64 cg, const __u32 *a, __u16 port, __u8 proto)
{
    // an IPv4-mapped address on a dual-stack socket goes out as IPv4: judge it as such
    if (mapped4(a))
        return local4(a[3]) || allowed4(cg, a[3], port, proto);
    return local6(a) || allowed6(cg, a, port, proto);
}

SEC("cgroup/connect4")
int egress_connect4(struct bpf_sock_addr *ctx)
{
    __u64 cg = bpf_get_current_cgroup_id();
    __u32 addr = ctx->user_ip4;
    __u16 port = (__u16)ctx->user_port;

    if (local4(addr) || allowed4(cg, addr, port, wire_proto(ctx->protocol)))
        return 1;
    return deny(cg, DENIED_CONNECT4);
}

SEC("cgroup/sendmsg4")
int egress_sendmsg4(struct bpf_sock_addr *ctx)
{
    __u64 cg = bpf_get_current_cgroup_id();
    __u32 addr = ctx->user_ip4;
    __u16 port = (__u16)ctx->user_port;

    if (local4(addr) || allowed4(cg, addr, port, wire_proto(ctx->protocol)))
        return 1;
    return deny(cg, DENIED_SENDMSG4);
}

SEC("cgroup/connect6")
int egress_connect6(struct bpf_sock_addr *ctx)
{
    __u64 cg = bpf_get_current_cgroup_id();
    __u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};

    if (check6(cg, a, (__u16)ctx->user_port, wire_proto(ctx->protocol)))
        return 1;
    return deny(cg, DENIED_CONNECT6);
}

SEC("cgroup/sendmsg6")
int egress_sendmsg6(struct bpf_sock_addr *ctx)
{
    __u64 cg = bpf_get_current_cgroup_id();
    __u32 a[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};

    if (check6(cg, a, (__u16)ctx->user_port, wire_proto(ctx->protocol)))
        return 1;
    return deny(cg, DENIED_SENDMSG6);
}

SEC("cgroup/sock_create")
int egress_sock_create(struct bpf_sock *sk)
{
    // Raw sockets write their own headers and skip connect/sendmsg; ICMP "ping" sockets have
    // no port. Neither can be allowlisted.
    if (sk->type == SOCK_RAW_TYPE || sk->protocol == IPPROTO_ICMP ||
        sk->protocol == IPPROTO_ICMPV6)
        return deny(bpf_get_current_cgroup_id(), DENIED_SOCKET);
    return 1;
}

SEC("cgroup_skb/egress")
int egress_packet(struct __sk_buff *skb)
{
    // the cgroup of the socket that sends it (this may run in softirq, for any task)
    __u64 cg = bpf_skb_cgroup_id(skb);
    __u16 ports[2];

    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;

        if (bpf_skb_load_bytes(skb, 0, &ip, sizeof(ip)))
            return deny(cg, DENIED_PACKET);
        if (local4(ip.daddr))
            return 1;
        // later fragments carry no ports: they cannot be matched, so they never pass
        if (ip.frag_off & bpf_htons(0x1fff))
            return deny(cg, DENIED_PACKET);
        if (bpf_skb_load_bytes(skb, ip.ihl * 4, ports, sizeof(ports)))
            return deny(cg, DENIED_PACKET);
        if (allowed4(cg, ip.daddr, ports[1], ip.protocol))
            return 1;
        return deny(cg, DENIED_PACKET);
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        __u32 a[4];

        if (bpf_skb_load_bytes(skb, 0, &ip6, sizeof(ip6)))
            return deny(cg, DENIED_PACKET);
        __builtin_memcpy(a, &ip6.daddr, sizeof(a));
        if (local6(a))
            return 1;
        // extension headers (fragments among them) are not walked: such packets never pass
        if (bpf_skb_load_bytes(skb, sizeof(ip6), ports, sizeof(ports)))
            return deny(cg, DENIED_PACKET);
        if (check6(cg, a, ports[1], ip6.nexthdr))
            return 1;
        return deny(cg, DENIED_PACKET);
    }
    return deny(cg, DENIED_PACKET);
}

static __always_inline int drop(__u64 cg)
{
    deny(cg, DENIED_PACKET);
    return TC_ACT_SHOT;
}

SEC("tc")
int guest_egress(struct __sk_buff *skb)
{
    __u32 ifindex = skb->ingress_ifindex;
    __u64 *found = bpf_map_lookup_elem(&ports, &ifindex);
    __u16 ports[2];

    if (!found)
        return TC_ACT_SHOT;  // a veth the node did not register: fail closed
    __u64 cg = *found;

    if (skb->protocol == bpf_htons(ETH_P_ARP))
        return TC_ACT_OK;  // the guest finding its gateway
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;

        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
            return drop(cg);
        if (ip.frag_off & bpf_htons(0x1fff))  // later fragments carry no ports
            return drop(cg);
        if (bpf_skb_load_bytes(skb, ETH_HLEN + ip.ihl * 4, ports, sizeof(ports)))
            return drop(cg);
        if (allowed4(cg, ip.daddr, ports[1], ip.protocol))
            return TC_ACT_OK;
        return drop(cg);
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        __u32 a[4];

        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)))
            return drop(cg);
        __builtin_memcpy(a, &ip6.daddr, sizeof(a));
        if (bpf_skb_load_bytes(skb, ETH_HLEN + sizeof(ip6), ports, sizeof(ports)))
            return drop(cg);
        if (allowed6(cg, a, ports[1], ip6.nexthdr))
            return TC_ACT_OK;
        return drop(cg);
    }
    return drop(cg);
}

char LICENSE[] SEC("license") = "GPL";
