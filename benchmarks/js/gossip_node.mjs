// One js-libp2p gossipsub node driven over stdin/stdout by a Python process
// (benchmarks/js_gossip.py, used by `benchmarks/gossip_bench.py --layout js`). Benchmark only:
// the node itself runs py-libp2p (node/p2p/).
//
// Usage: INTELLECT_JS_GOSSIP='<config JSON>' node gossip_node.mjs   (install first: npm ci --prefix benchmarks/js)
//   (in the environment, not argv: argv is readable by every user, the environment only by the owner)
//   config: {seed: 64 hex chars (the node's ed25519 seed), port, topics: [5 topic names, by kind
//   index], subscribe: [kind indices], hub: bool, bootstrap: [multiaddrs], target_peers,
//   max_peers, validate_timeout_ms}
//
// Frames, both ways: u32 big-endian length of what follows, u8 op, payload.
//   node -> python: 'R' JSON {peer_id, addrs}           once listening
//                   'V' u32 id, u8 kind, data          ask the topic validator (awaited before forwarding)
//                   'D' u8 kind, 32-byte SHA-256        a validated message was delivered to this node
//                   'S' JSON stats                      answer to 'S'
//   python -> node: 'v' u32 id, u8 result               0 accept, 1 reject, 2 ignore
//                   'P' u8 kind, data                   publish
//                   'C' utf8 multiaddr (with /p2p/)    a peer learned from a record (dialed while below target_peers)
//                   'S'                                 stats request
// stdin closing stops the node. Logs go to stderr only.
import { createHash } from 'node:crypto'
import { gossipsub } from '@chainsafe/libp2p-gossipsub'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { generateKeyPairFromSeed } from '@libp2p/crypto/keys'
import { identify } from '@libp2p/identify'
import { TopicValidatorResult } from '@libp2p/interface'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

// Promise.withResolvers is Node.js 22+; it-queue (under libp2p 2.9's peer store) calls it at run time,
// and Node.js 20 is what is installed here. Set before any libp2p code runs (imports only define functions).
Promise.withResolvers ??= function () {
  let resolve, reject
  const promise = new this((res, rej) => { resolve = res; reject = rej })
  return { promise, resolve, reject }
}

const cfg = JSON.parse(process.env.INTELLECT_JS_GOSSIP)
delete process.env.INTELLECT_JS_GOSSIP
const RESULTS = [TopicValidatorResult.Accept, TopicValidatorResult.Reject, TopicValidatorResult.Ignore]

function frame (op, ...parts) {
  const body = Buffer.concat([Buffer.from(op, 'latin1'), ...parts])
  const head = Buffer.alloc(4)
  head.writeUInt32BE(body.length)
  return Buffer.concat([head, body])
}
const send = (op, ...parts) => process.stdout.write(frame(op, ...parts))

const privateKey = await generateKeyPairFromSeed('Ed25519', Buffer.from(cfg.seed, 'hex'))
const node = await createLibp2p({
  privateKey,
  addresses: { listen: [`/ip4/127.0.0.1/tcp/${cfg.port ?? 0}`] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  // every test peer shares 127.0.0.1: the per-host inbound rate limit would refuse the workers joining a hub
  connectionManager: { maxConnections: cfg.max_peers, inboundConnectionThreshold: 10000 },
  services: {
    identify: identify(),
    pubsub: gossipsub({
      D: 6,
      Dlo: 4,
      // a hub keeps every worker that grafts it (as node/p2p's hub_full_mesh); workers the usual 12
      Dhi: cfg.hub ? cfg.max_peers : 12,
      heartbeatInterval: 1000,
      allowPublishToZeroTopicPeers: true,
      emitSelf: false,
      doPX: false,
      // message ID = SHA-256 of the payload, as the node's py-libp2p router: two copies of one envelope are one message
      msgIdFn: (msg) => createHash('sha256').update(msg.data).digest(),
      // IP colocation penalty off: every peer here is 127.0.0.1 (the node turns IP diversity off too)
      scoreParams: { IPColocationFactorWeight: 0 }
    })
  }
})
const pubsub = node.services.pubsub

// topic validator: ask Python, wait for its answer (bounded), before gossipsub forwards anything
let nextId = 0
let timeouts = 0 // validator answers that came too late (the message was ignored)
const pending = new Map() // id -> resolve
const kindOf = new Map(cfg.topics.map((t, i) => [t, i]))
for (const k of cfg.subscribe) {
  const topic = cfg.topics[k]
  pubsub.topicValidators.set(topic, (_from, msg) => new Promise((resolve) => {
    const id = nextId = (nextId + 1) >>> 0
    const timer = setTimeout(() => { pending.delete(id); timeouts++; resolve(TopicValidatorResult.Ignore) }, cfg.validate_timeout_ms ?? 5000)
    pending.set(id, (r) => { clearTimeout(timer); resolve(r) })
    const head = Buffer.alloc(5)
    head.writeUInt32BE(id)
    head.writeUInt8(k, 4)
    send('V', head, msg.data)
  }))
  pubsub.subscribe(topic)
}
pubsub.addEventListener('message', (evt) => {
  const k = kindOf.get(evt.detail.topic)
  if (k === undefined) return
  send('D', Buffer.from([k]), createHash('sha256').update(evt.detail.data).digest())
})

// bootstrap peers dialed forever; peers learned from records while below target_peers
const known = new Map() // peer ID string -> multiaddr
const bootstrap = (cfg.bootstrap ?? []).map((a) => multiaddr(a))
const connected = (pid) => node.getConnections().some((c) => c.remotePeer.toString() === pid)
async function dial (ma) {
  try { await node.dial(ma, { signal: AbortSignal.timeout(10000) }) } catch (e) { /* retried next tick */ }
}
function topUp () {
  for (const ma of bootstrap) if (!connected(ma.getPeerId())) dial(ma)
  let have = node.getConnections().length
  for (const [pid, ma] of known) {
    if (have >= cfg.target_peers) break
    if (pid !== node.peerId.toString() && !connected(pid)) { dial(ma); have++ }
  }
}
const ticker = setInterval(topUp, 1000)
topUp()

function stats () {
  const mesh = {}
  for (const t of cfg.subscribe) mesh[t] = pubsub.getMeshPeers(cfg.topics[t]).length
  return { connections: node.getConnections().length, mesh, validator_timeouts: timeouts }
}

let buf = Buffer.alloc(0)
process.stdin.on('data', (chunk) => {
  buf = buf.length ? Buffer.concat([buf, chunk]) : chunk
  while (buf.length >= 4) {
    const n = buf.readUInt32BE(0)
    if (buf.length < 4 + n) break
    const op = String.fromCharCode(buf[4])
    const p = buf.subarray(5, 4 + n)
    buf = buf.subarray(4 + n)
    if (op === 'v') {
      const resolve = pending.get(p.readUInt32BE(0))
      if (resolve) { pending.delete(p.readUInt32BE(0)); resolve(RESULTS[p[4]] ?? TopicValidatorResult.Ignore) }
    } else if (op === 'P') {
      pubsub.publish(cfg.topics[p[0]], Uint8Array.prototype.slice.call(p, 1)).catch((e) => process.stderr.write(`publish: ${e.message}\n`))
    } else if (op === 'C') {
      const ma = multiaddr(p.toString('utf8'))
      const pid = ma.getPeerId()
      if (pid) known.set(pid, ma)
      if (pid && node.getConnections().length < cfg.target_peers && !connected(pid)) dial(ma)
    } else if (op === 'S') {
      send('S', Buffer.from(JSON.stringify(stats())))
    }
  }
})
process.stdin.on('end', async () => {
  clearInterval(ticker)
  process.stderr.write(`js-libp2p node ${node.peerId}: ${JSON.stringify(stats())}\n`)
  await node.stop()
  process.exit(0)
})

send('R', Buffer.from(JSON.stringify({ peer_id: node.peerId.toString(), addrs: node.getMultiaddrs().map((a) => a.toString()) })))
