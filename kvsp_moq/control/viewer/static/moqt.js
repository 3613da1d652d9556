// A small MOQT client for the browser: draft-ietf-moq-transport-22 over WebTransport
// (docs/viewer.md). It does what the block viewer needs and no more: SETUP, SUBSCRIBE,
// FETCH, and the data streams that answer them (subgroup and fetch streams). Section names
// are those of draft-22 (moqt-reference §2); every read is bounded and every wait has a
// deadline. No npm client speaks a draft we speak (@moq/lite 0.2: moq-lite, drafts 14-17).

export const VERSION = "moqt-22";
// Session close codes (§"Session Termination") and request error codes (§"REQUEST_ERROR").
export const PROTOCOL_VIOLATION = 0x3;
const MAX_MESSAGE = 0xffff;          // §"Control Messages": Message Length is 16 bits
const MAX_REASON = 1024;             // §"Reason Phrase"
const MAX_PROPERTIES = 0xffff;       // object Properties Length we accept (a KVP value's limit)
const MAX_KVP_VALUE = 0xffff;        // §"Key-Value-Pair Structure"

/** An error carrying the MOQT code the draft names for it. */
export class MoqtError extends Error {
  constructor(code, message) { super(message); this.code = code; }
}
const violation = (what) => new MoqtError(PROTOCOL_VIOLATION, what);

// -- vi64 (§"Variable-Length Integers"): the count of leading 1 bits of the first byte
// gives the length (1..9 bytes). Values above 2^53 - 1 are read as Infinity (no ID this
// client asks for is that large; 2^64 - 1 means "unknown" where the draft allows it).
export function viLength(first) {
  let n = 1;
  while (n < 9 && (first & (0x80 >> (n - 1)))) n++;
  return n;
}

export function encodeVi(value) {
  if (!Number.isSafeInteger(value) || value < 0) throw new RangeError(`not a vi64: ${value}`);
  for (let len = 1; len <= 8; len++) {
    const bits = len === 8 ? 56 : 7 * len;
    if (value < 2 ** bits) {
      const out = new Uint8Array(len);
      let v = value;
      for (let i = len - 1; i >= 0; i--) { out[i] = v % 256; v = Math.floor(v / 256); }
      out[0] |= len === 8 ? 0xfe : (0xff << (8 - (len - 1))) & 0xff;
      return out;
    }
  }
  const out = new Uint8Array(9);
  out[0] = 0xff;
  let v = value;
  for (let i = 8; i >= 1; i--) { out[i] = v % 256; v = Math.floor(v / 256); }
  return out;
}

function decodeViBytes(bytes) {  // bytes.length == viLength(bytes[0])
  const len = bytes.length;
  let v = len === 9 ? 0 : len === 8 ? 0 : bytes[0] & (0xff >> len);
  for (let i = 1; i < len; i++) v = v * 256 + bytes[i];
  return Number.isSafeInteger(v) ? v : Infinity;
}

/** Bytes being built: vi64s, single bytes, 16-bit lengths, byte strings. */
export class Writer {
  constructor() { this.parts = []; this.size = 0; }
  raw(bytes) { this.parts.push(bytes); this.size += bytes.length; return this; }
  vi(v) { return this.raw(encodeVi(v)); }
  u8(v) { return this.raw(Uint8Array.of(v)); }
  bytes(b) { return this.vi(b.length).raw(b); }
  namespace(fields) { this.vi(fields.length); for (const f of fields) this.bytes(f); return this; }
  finish() {
    const out = new Uint8Array(this.size);
    let at = 0;
    for (const p of this.parts) { out.set(p, at); at += p.length; }
    return out;
  }
}

/** A control message: Type (vi64), Message Length (16), Message Body (§"Control Messages"). */
export function message(type, body) {
  if (body.length > MAX_MESSAGE) throw new RangeError("message body over 65535 bytes");
  return new Writer().vi(type).u8(body.length >> 8).u8(body.length & 0xff).raw(body).finish();
}

/** Reads a message body held whole (at most 65535 bytes): every read checks the bound. */
export class BodyReader {
  constructor(bytes) { this.b = bytes; this.at = 0; }
  get left() { return this.b.length - this.at; }
  need(n, what) { if (this.left < n) throw violation(`message ends inside ${what}`); }
  u8(what = "a byte") { this.need(1, what); return this.b[this.at++]; }
  vi(what = "a varint") {
    this.need(1, what);
    const len = viLength(this.b[this.at]);
    this.need(len, what);
    const v = decodeViBytes(this.b.subarray(this.at, this.at + len));
    this.at += len;
    return v;
  }
  bytes(n, what) { this.need(n, what); const out = this.b.subarray(this.at, this.at + n); this.at += n; return out; }
  lengthPrefixed(limit, what) {
    const n = this.vi(what);
    if (n > limit) throw violation(`${what} longer than ${limit} bytes`);
    return this.bytes(n, what);
  }
  reason() { return new TextDecoder().decode(this.lengthPrefixed(MAX_REASON, "a Reason Phrase")); }
  location() { return { group: this.vi("a Group"), object: this.vi("an Object") }; }
  end(what) { if (this.left) throw violation(`${this.left} bytes left over after ${what}`); }
}

/** Key-Value-Pairs to the end of ``r`` (§"Key-Value-Pair Structure": delta-coded types;
 * even: one vi64, odd: length + bytes). Returns a Map type -> value. */
export function readKvps(r) {
  const out = new Map();
  let type = 0;
  while (r.left) {
    type += r.vi("a property type");
    if (!Number.isSafeInteger(type)) throw violation("property type over 2^53");
    const value = type % 2 === 0 ? r.vi("a property value") : r.lengthPrefixed(MAX_KVP_VALUE, "a property value");
    if (!out.has(type)) out.set(type, value);
  }
  return out;
}

// Message Parameters we may receive in SUBSCRIBE_OK / FETCH_OK (§"Message Parameters"):
// EXPIRES (vi64), LARGEST_OBJECT (Location). Any other type cannot be skipped: a violation.
const EXPIRES = 0x08, LARGEST_OBJECT = 0x09;
function readParameters(r, allowed) {
  const count = r.vi("Number of Parameters");
  const out = new Map();
  let type = 0;
  for (let i = 0; i < count; i++) {
    type += r.vi("a parameter type");
    if (!allowed.has(type)) throw violation(`parameter 0x${type.toString(16)} not allowed here`);
    out.set(type, type === LARGEST_OBJECT ? r.location() : r.vi("a parameter value"));
  }
  return out;
}

/** Pulls the bytes of one WebTransport stream (a ReadableStream of Uint8Array) with at
 * most ``limit`` bytes held: reads ask for what they need, payloads go to their buffer. */
export class StreamReader {
  constructor(readable, limit = 1 << 17) {
    this.reader = readable.getReader();
    this.chunks = [];
    this.held = 0;
    this.limit = limit;
    this.done = false;
  }
  async fill(n) {
    if (n > this.limit) throw violation(`a field of ${n} bytes is over the ${this.limit}-byte bound`);
    while (this.held < n) {
      const { value, done } = await this.reader.read();
      if (done) { this.done = true; return false; }
      if (value.length) { this.chunks.push(value); this.held += value.length; }
    }
    return true;
  }
  take(n) {  // n <= held
    const out = new Uint8Array(n);
    let at = 0;
    while (at < n) {
      const c = this.chunks[0];
      const k = Math.min(c.length, n - at);
      out.set(c.subarray(0, k), at);
      at += k;
      if (k === c.length) this.chunks.shift(); else this.chunks[0] = c.subarray(k);
    }
    this.held -= n;
    return out;
  }
  /** Whether the stream ended cleanly here (FIN, nothing held). */
  async atEnd() { return !(await this.fill(1)) && this.held === 0; }
  async exactly(n, what) {
    if (!(await this.fill(n))) throw violation(`stream ends inside ${what}`);
    return this.take(n);
  }
  async vi(what = "a varint") {
    const first = (await this.exactly(1, what))[0];
    const len = viLength(first);
    const rest = len > 1 ? await this.exactly(len - 1, what) : new Uint8Array(0);
    const all = new Uint8Array(len);
    all[0] = first;
    all.set(rest, 1);
    return decodeViBytes(all);
  }
  async u8(what) { return (await this.exactly(1, what))[0]; }
  /** A control message: {type, body: BodyReader}; null at a clean end of stream. */
  async message() {
    if (await this.atEnd()) return null;
    const type = await this.vi("a Message Type");
    const head = await this.exactly(2, "a Message Length");
    const length = (head[0] << 8) | head[1];
    return { type, body: new BodyReader(await this.exactly(length, "a Message Body")) };
  }
  /** ``n`` payload bytes straight into ``dst`` at ``offset`` (never held here). */
  async into(dst, offset, n) {
    let at = 0;
    while (at < n) {
      if (this.held === 0 && !(await this.fill(1))) throw violation("stream ends inside an Object Payload");
      const c = this.chunks[0];
      const k = Math.min(c.length, n - at);
      dst.set(c.subarray(0, k), offset + at);
      at += k;
      this.held -= k;
      if (k === c.length) this.chunks.shift(); else this.chunks[0] = c.subarray(k);
    }
  }
  cancel(code) { this.reader.cancel(code).catch(() => {}); }
}

/** Properties of one object: Properties Length (vi64) + KVPs (§"Object Properties"). */
async function objectProperties(s) {
  const length = await s.vi("Properties Length");
  if (length > MAX_PROPERTIES) throw violation("object properties over 65535 bytes");
  return readKvps(new BodyReader(await s.exactly(length, "object properties")));
}

/** A subgroup stream after its type byte (§"Subgroup Header"): header, then objects.
 * ``onObject(header, object)`` returns where the payload goes ({dst, offset}) or null to
 * refuse it (the stream is then cancelled). */
export async function readSubgroup(s, flags, { headerReady, onObject }) {
  if (!(flags & 0x10) || flags > 0x7d || (flags & 0x06) === 0x06) throw violation(`invalid subgroup type 0x${flags.toString(16)}`);
  const alias = await s.vi("Track Alias");
  const group = await s.vi("Group ID");
  const mode = (flags & 0x06) >> 1;
  let subgroup = mode === 2 ? await s.vi("Subgroup ID") : mode === 0 ? 0 : null;
  const priority = flags & 0x20 ? null : await s.u8("Publisher Priority");
  const header = { alias, group, subgroup, priority };
  await headerReady(header);
  let prior = null;
  while (!(await s.atEnd())) {
    const delta = await s.vi("Object ID Delta");
    const object = prior === null ? delta : prior + delta + 1;
    if (subgroup === null) subgroup = header.subgroup = object;
    prior = object;
    const properties = flags & 0x01 ? await objectProperties(s) : new Map();
    const length = await s.vi("Object Payload Length");
    let status = 0;
    if (length === 0) status = await s.vi("Object Status");
    const target = onObject(header, { group, object, properties, length, status });
    if (!target) { s.cancel(); return; }
    await s.into(target.dst, target.offset, length);
    if (target.done) await target.done();
  }
}

/** A fetch stream after its type (§"Fetch Header"): Request ID, then delta-coded objects. */
export async function readFetch(s, { onObject }) {
  let group = null, object = null, priority = null, subgroup = null;
  while (!(await s.atEnd())) {
    const flags = await s.vi("Serialization Flags");
    if (flags >= 0x80) {
      if (flags !== 0x8c && flags !== 0x10c && flags !== 0x20c) throw violation(`invalid Serialization Flags 0x${flags.toString(16)}`);
      group = await s.vi("Group ID"); object = await s.vi("Object ID");
      if (await s.vi("Object Payload Length")) throw violation("End of Range with a payload");
      continue;  // an End of Range: the objects it names do not exist
    }
    const gd = flags & 0x08 ? await s.vi("Group ID Delta") : null;
    const sg = !(flags & 0x40) && (flags & 0x03) === 0x03 ? await s.vi("Subgroup ID") : null;
    const od = flags & 0x04 ? await s.vi("Object ID Delta") : null;
    const pr = flags & 0x10 ? await s.u8("Publisher Priority") : null;
    const properties = flags & 0x20 ? await objectProperties(s) : new Map();
    const length = await s.vi("Object Payload Length");
    if (group === null) {
      if (gd === null || od === null) throw violation("first fetch object must carry Group ID and Object ID");
      group = gd; object = od;
    } else {
      if (gd !== null) { group = group + gd + 1; object = od === null ? object + 1 : od; }  // ascending
      else object = od === null ? object + 1 : object + od;
    }
    if (pr !== null) priority = pr; else if (priority === null) throw violation("fetch object inherits no Priority");
    const mode = flags & 0x03;
    if (flags & 0x40) subgroup = null;           // forwarded as a datagram: no Subgroup ID
    else if (mode === 3) subgroup = sg;
    else if (mode === 0) subgroup = 0;
    else if (subgroup === null) throw violation("fetch object refers to no prior Subgroup ID");
    else subgroup += mode - 1;                   // 1: the prior one, 2: the prior one + 1
    const target = onObject({ group, object, properties, length, status: 0 });
    if (!target) { s.cancel(); return; }
    await s.into(target.dst, target.offset, length);
    if (target.done) await target.done();
  }
}

// -- the control messages this client sends and reads (§"SUBSCRIBE", §"FETCH", ...) --------

/** SUBSCRIBE: Request ID, Track Namespace, Track Name, 1 parameter: LOCATION_FILTER
 * Next Object (draft-22 typed filter, no length: ``21 05``). */
export function encodeSubscribe(requestId, namespace, name) {
  return message(0x03, new Writer().vi(requestId).namespace(namespace).bytes(name)
    .vi(1).vi(0x21).vi(0x05).finish());
}

/** Standalone FETCH (draft 20+: no Fetch Type, the range is LOCATION_FILTER): objects
 * ``{group, first}``..``{group, last}`` inclusive (draft-22 filter type 0x04: StartGroup,
 * StartObject, EndGroupDelta 0, EndObject). */
export function encodeFetch(requestId, namespace, name, group, first, last) {
  return message(0x16, new Writer().vi(requestId).namespace(namespace).bytes(name)
    .vi(1).vi(0x21).vi(0x04).vi(group).vi(first).vi(0).vi(last).finish());
}

/** SUBSCRIBE_OK: Track Alias, Parameters, Track Properties (to the end). */
export function decodeSubscribeOk(r) {
  const alias = r.vi("Track Alias");
  const params = readParameters(r, new Set([EXPIRES, LARGEST_OBJECT]));
  return { alias, largest: params.get(LARGEST_OBJECT) || null, expires: params.get(EXPIRES) ?? null,
           properties: readKvps(r) };
}

/** FETCH_OK: End Of Track (8), End Location, Parameters, Track Properties. */
export function decodeFetchOk(r) {
  const endOfTrack = r.u8("End Of Track");
  if (endOfTrack > 1) throw violation(`End Of Track ${endOfTrack}`);
  const end = r.location();
  readParameters(r, new Set([EXPIRES, LARGEST_OBJECT]));
  return { endOfTrack, end, properties: readKvps(r) };
}

/** REQUEST_ERROR: Error Code, Retry Interval, Reason Phrase (a Redirect, if any, ignored). */
export function decodeRequestError(r) {
  return { code: r.vi("Error Code"), retry: r.vi("Retry Interval"), reason: r.reason() };
}

/** PUBLISH_DONE: Status Code, Stream Count (2^64-1 = unknown: Infinity), Reason Phrase. */
export function decodePublishDone(r) {
  const done = { status: r.vi("Status Code"), streams: r.vi("Stream Count"), reason: r.reason() };
  r.end("PUBLISH_DONE");
  return done;
}

function withDeadline(promise, ms, what) {
  let timer;
  const deadline = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms); });
  return Promise.race([promise, deadline]).finally(() => clearTimeout(timer));
}

/** A data stream's request or Track Alias did not become known within the timeout. */
class Unclaimed extends Error {}

/** Where a request's data streams go, and how many of them have ended. */
class DataHandler {
  constructor(onObject) { this.onObject = onObject; this.count = 0; this.waiters = []; }
  streamEnded() {
    this.count++;
    this.waiters = this.waiters.filter(([n, resolve]) => (this.count >= n ? (resolve(), false) : true));
  }
  /** Resolves once ``n`` data streams have ended (a FETCH: 1; a subscription: the Stream
   * Count of its PUBLISH_DONE). */
  ended(n) { return this.count >= n ? Promise.resolve() : new Promise((resolve) => this.waiters.push([n, resolve])); }
}

const hexBytes = (hex) => Uint8Array.from(hex.match(/../g).map((h) => parseInt(h, 16)));

/** One MOQT session over WebTransport. ``await MoqtSession.connect(url, opts)``. */
export class MoqtSession {
  static async connect(url, { certificateSha256 = null, timeoutMs = 10000, implementation = "kvsp-viewer" } = {}) {
    const options = { protocols: [VERSION] };
    if (certificateSha256) options.serverCertificateHashes = [{ algorithm: "sha-256", value: hexBytes(certificateSha256) }];
    const wt = new WebTransport(url, options);
    await withDeadline(wt.ready, timeoutMs, "WebTransport session");
    // §"Session establishment": WT-Protocol names the version; none = the server's first (22).
    if (wt.protocol && wt.protocol !== VERSION) throw new Error(`server chose ${wt.protocol}, not ${VERSION}`);
    const session = new MoqtSession(wt, timeoutMs);
    const control = await wt.createUnidirectionalStream();
    session.control = control.getWriter();
    const options22 = new Writer().vi(0x07).bytes(new TextEncoder().encode(implementation)).finish();
    await session.control.write(message(0x2f00, options22));  // SETUP with MOQT_IMPLEMENTATION
    session.acceptStreams();
    await withDeadline(session.setup, timeoutMs, "SERVER SETUP");
    return session;
  }

  constructor(wt, timeoutMs) {
    this.wt = wt;
    this.timeoutMs = timeoutMs;
    this.nextRequestId = 0;          // client request IDs are even (§"Request ID")
    this.aliases = new Map();        // Track Alias -> subscription handler
    this.aliasWaiters = new Map();
    this.fetches = new Map();        // Request ID -> fetch handler
    this.fetchWaiters = new Map();
    this.serverOptions = null;
    this.controlSeen = false;
    this.unclaimed = 0;              // data streams cancelled: no request claimed them in time
    this.setup = new Promise((resolve, reject) => { this.setupDone = resolve; this.setupFailed = reject; });
    this.closed = wt.closed;
  }

  fail(err) {
    const code = err instanceof MoqtError ? err.code : 0x1;
    try { this.wt.close({ closeCode: code, reason: String(err.message).slice(0, 1024) }); } catch (_) { /* closed */ }
    this.setupFailed(err);
    if (this.onerror) this.onerror(err);
  }

  async acceptStreams() {
    const reader = this.wt.incomingUnidirectionalStreams.getReader();
    for (;;) {
      let next;
      try { next = await reader.read(); } catch (_) { return; }
      if (next.done) return;
      this.uniStream(new StreamReader(next.value)).catch((err) => this.fail(err));
    }
  }

  async uniStream(s) {
    const type = await s.vi("a stream type");
    if (type === 0x2f00) {
      if (this.controlSeen) throw violation("a second control stream");
      this.controlSeen = true;
      return this.controlStream(s);
    }
    if (type === 0x132b3e28) return s.cancel();  // a PADDING stream
    if (type !== 0x05 && !(type >= 0x10 && type <= 0x7d)) throw violation(`unknown stream type 0x${type.toString(16)}`);
    try {
      if (type === 0x05) {
        const id = await s.vi("Request ID");
        const handler = await this.waitFor(this.fetches, this.fetchWaiters, id, "fetch stream's request");
        await readFetch(s, handler);
        return handler.streamEnded();
      }
      const header = {};
      await readSubgroup(s, type, {
        headerReady: async (h) => { header.handler = await this.waitFor(this.aliases, this.aliasWaiters, h.alias, "subgroup's Track Alias"); },
        onObject: (h, o) => header.handler.onObject(o),
      });
      return header.handler.streamEnded();
    } catch (err) {
      if (!(err instanceof Unclaimed)) throw err;
      this.unclaimed++;  // a data stream no request of ours claimed in time: cancel it alone
      s.cancel();
    }
  }

  /** A data stream may come before the answer that names it: wait (bounded) for it. */
  waitFor(map, waiters, key, what) {
    if (map.has(key)) return Promise.resolve(map.get(key));
    let list = waiters.get(key);
    if (!list) waiters.set(key, list = []);
    return withDeadline(new Promise((resolve) => list.push(resolve)), this.timeoutMs, what)
      .catch((err) => { throw new Unclaimed(err.message); });
  }

  register(map, waiters, key, handler) {
    map.set(key, handler);
    for (const resolve of waiters.get(key) || []) resolve(handler);
    waiters.delete(key);
  }

  async controlStream(s) {
    const length = (await s.exactly(2, "SETUP's Message Length"));
    const body = new BodyReader(await s.exactly((length[0] << 8) | length[1], "SETUP"));
    this.serverOptions = readKvps(body);  // unknown Setup Options are ignored (§"SETUP")
    this.setupDone();
    for (;;) {
      const m = await s.message();
      if (m === null) throw violation("the control stream was closed");
      if (m.type === 0x10) this.goaway = m.body;  // GOAWAY: this viewer just finishes
      else throw violation(`message 0x${m.type.toString(16)} on the control stream`);
    }
  }

  async request(bytes) {
    const stream = await this.wt.createBidirectionalStream();
    const writer = stream.writable.getWriter();
    await writer.write(bytes);
    return { writer, reader: new StreamReader(stream.readable) };
  }

  requestId() { const id = this.nextRequestId; this.nextRequestId += 2; return id; }

  static answerError(m) {
    const e = decodeRequestError(m.body);
    const err = new Error(`REQUEST_ERROR 0x${e.code.toString(16)}: ${e.reason}`);
    err.requestError = e;
    return err;
  }

  /** SUBSCRIBE with LOCATION_FILTER Next Object. Returns {alias, largest, properties, done,
   * streamsEnded}; ``done`` resolves to PUBLISH_DONE (null: the stream ended without one). */
  async subscribe(namespace, name, onObject) {
    const { reader } = await this.request(encodeSubscribe(this.requestId(), namespace, name));
    const m = await withDeadline(reader.message(), this.timeoutMs, "SUBSCRIBE's answer");
    if (m === null) throw new Error("SUBSCRIBE's stream ended without an answer");
    if (m.type === 0x05) throw MoqtSession.answerError(m);
    if (m.type !== 0x04) throw violation(`answer 0x${m.type.toString(16)} to SUBSCRIBE`);
    const ok = decodeSubscribeOk(m.body);
    const handler = new DataHandler(onObject);
    this.register(this.aliases, this.aliasWaiters, ok.alias, handler);
    const done = (async () => {
      for (;;) {
        const next = await reader.message();
        if (next === null) return null;
        if (next.type === 0x0b) return decodePublishDone(next.body);
        if (next.type !== 0x22) throw violation(`message 0x${next.type.toString(16)} on a subscription`);
      }
    })();
    done.catch((err) => this.fail(err));
    return { ...ok, done, streamsEnded: (count) => handler.ended(count) };
  }

  /** FETCH of group ``group``'s objects ``first``..``last``; resolves at FETCH_OK to
   * {endOfTrack, end, properties, streamEnded} (``streamEnded``: its fetch stream ended). */
  async fetch(namespace, name, group, first, last, onObject) {
    const id = this.requestId();
    const handler = new DataHandler(onObject);
    this.register(this.fetches, this.fetchWaiters, id, handler);
    const { reader } = await this.request(encodeFetch(id, namespace, name, group, first, last));
    const m = await withDeadline(reader.message(), this.timeoutMs, "FETCH's answer");
    if (m === null) throw new Error("FETCH's stream ended without an answer");
    if (m.type === 0x05) throw MoqtSession.answerError(m);
    if (m.type !== 0x18) throw violation(`answer 0x${m.type.toString(16)} to FETCH`);
    return { ...decodeFetchOk(m.body), streamEnded: handler.ended(1) };
  }

  close() { try { this.wt.close({ closeCode: 0, reason: "" }); } catch (_) { /* closed */ } }
}
