/* OTLP/protobuf trace export requests, decoded in one pass into the collector's rows and columns.
 *
 * The native half of kvtrace.collectors.model.decode (the pure-Python decode_python there is the
 * reference, and the tests hold the two to the same output). It reads the protobuf wire format
 * of ExportTraceServiceRequest directly, without building message objects, and makes for each
 * span one row (an instance of model.SpanRow, a tuple subclass) and one entry in each of the
 * store's columns (ids and times as packed binary, ready for Arrow without a copy per value).
 * Attributes are read only for the keys the caller asks for; every other field is skipped,
 * not checked (as the OpenTelemetry Collector's own lazy decoding would not). A span whose ids or times are wrong stops the request: its bytes are returned
 * so that Python can say what is wrong with it.
 *
 *   decode(payload, latest_ns, row_type, origin_of, span_keys, resource_keys, stage_key)
 *     -> (rows, origins, columns) or (None, bad_span_bytes, None)
 *   columns = (trace_ids, span_ids, parent_ids, starts, ends, statuses, origin_index, names, stages)
 *
 * span_keys / resource_keys: dict of wanted attribute key (bytes) -> key (str).
 * origin_of(resource_attributes: dict, resource: bytes) -> Origin, whose `stages` dict maps a
 * span name to its stage. Malformed protobuf raises ValueError.
 *
 *   attributes(keys, values) -> bytes
 *
 * The other way, for the collector's own spans: `Span.attributes` entries (field 9) for each key
 * whose value is not None, in order: a str, bool, int (int64, two's complement) or float (double).
 * The native half of kvtrace.collectors.wire.attributes (the reference; the tests hold the two to
 * the same bytes).
 *
 *   stage_columns(breakdowns, known) -> (ids, starts, ends, critical, offsets, unknown)
 *
 * The requests table's per-stage list columns: for each breakdown, each (side, stage) of its
 * `timings` dict in order: its id in `known` (-1 where it has none; those keys listed once each in
 * `unknown`), its start and end (the timing's first two items) and its `critical_ns` (0 where
 * absent), packed int64; `offsets` (int32, one more than breakdowns) says where each breakdown's
 * stages begin. The native half of kvtrace.collectors.store.stage_columns.
 *
 *   walk(timings, graph, start, end, config) -> (parts, critical, segments)
 *
 * The critical path from `end` back to `start` over a trace's stage timings, step for step as
 * kvtrace.collectors.attribution.walk_python (the reference; the tests hold the two to the same
 * output on contract traces and 20,000 random ones). config = (derived, root, gap, categories,
 * coordination, unattributed, first_keys): attribution._WALK_CONFIG. A time beyond int64 raises
 * OverflowError (Python then walks it).
 *
 *   index_spans(spans, config) -> (index, first_of, ranks, failed, mode, p_any, d_any, client)
 *   timings_of(index, offsets, stage_category, unlisted) -> timings
 *
 * A trace's spans indexed for its attribution, and each indexed stage's timing on the reference clock:
 * step for step as kvtrace.collectors.attribution.index_spans_python and timings_of_python (the
 * references; the tests hold them to the same output on contract traces and 5,000 hostile ones).
 *
 *   details(breakdown, spans, config) -> None
 *
 * The detail attributes' values set on the breakdown: step for step as
 * kvtrace.collectors.attribution.details_python (the reference; the tests hold the two to the same
 * breakdowns on contract traces and 5,000 hostile ones).
 *
 *   explain(breakdown, config) -> str
 *
 * The breakdown's one sentence, word for word as kvtrace.collectors.explain.explain_python (the
 * reference; the tests hold the two to the same sentence). config = explain._NATIVE_CONFIG. A number
 * beyond what C carries exactly raises OverflowError, a value of another type TypeError (Python then
 * explains it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MIN_TIME_NS 946684800000000000ULL /* 2000-01-01 */
#define MAX_KEYS 32
#define ROW_FIELDS 12 /* model.SpanRow */
#define NAME_CACHE 32 /* distinct span names remembered per request */

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };

typedef struct {
    const uint8_t *p, *end;
} Reader;

typedef struct {
    Py_ssize_t count;
    const char *key[MAX_KEYS];
    Py_ssize_t len[MAX_KEYS];
    PyObject *name[MAX_KEYS]; /* borrowed from the caller's dict */
} Keys;

static int malformed(const char *what) {
    PyErr_SetString(PyExc_ValueError, what);
    return -1;
}

static int read_varint(Reader *r, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return malformed("truncated varint");
        uint8_t b = *r->p++;
        value |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) {
            *out = value;
            return 0;
        }
    }
    return malformed("varint over 10 bytes");
}

/* The next field's number and wire type; 0 at the end of the message. */
static int read_tag(Reader *r, uint32_t *field, int *wire_type) {
    uint64_t tag;
    if (read_varint(r, &tag) < 0) return -1;
    *field = (uint32_t)(tag >> 3);
    *wire_type = (int)(tag & 7);
    if (*field == 0 || tag >> 32) return malformed("bad field number");
    return 1;
}

static int read_len(Reader *r, Reader *inner) {
    uint64_t n;
    if (read_varint(r, &n) < 0) return -1;
    if (n > (uint64_t)(r->end - r->p)) return malformed("length past the end");
    inner->p = r->p;
    inner->end = r->p + n;
    r->p += n;
    return 0;
}

static int skip_field(Reader *r, uint32_t field, int wire_type, int depth) {
    uint64_t ignored;
    Reader inner;
    switch (wire_type) {
    case WT_VARINT: return read_varint(r, &ignored);
    case WT_I64:
        if (r->end - r->p < 8) return malformed("truncated fixed64");
        r->p += 8;
        return 0;
    case WT_I32:
        if (r->end - r->p < 4) return malformed("truncated fixed32");
        r->p += 4;
        return 0;
    case WT_LEN: return read_len(r, &inner);
    case WT_SGROUP:
        if (depth > 64) return malformed("groups nested too deep");
        for (;;) {
            uint32_t f;
            int wt;
            if (r->p >= r->end) return malformed("unterminated group");
            if (read_tag(r, &f, &wt) < 0) return -1;
            if (wt == WT_EGROUP) return f == field ? 0 : malformed("mismatched group end");
            if (skip_field(r, f, wt, depth + 1) < 0) return -1;
        }
    default: return malformed("bad wire type");
    }
}

static int read_fixed64(Reader *r, uint64_t *out) {
    if (r->end - r->p < 8) return malformed("truncated fixed64");
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | r->p[i];
    r->p += 8;
    *out = v;
    return 0;
}

/* A known field with another wire type is an unknown field to protobuf: skipped, as upb does. */
#define READ_AS(wanted_type, read)                                  \
    if (wt != (wanted_type)) {                                      \
        if (skip_field(&r, field, wt, 0) < 0) goto error;           \
    } else if ((read) < 0) {                                        \
        goto error;                                                 \
    }

/* An AnyValue as Python, as model.value_of reads it: a non-empty string, a non-zero int or
 * double, true; anything else (including arrays, maps, bytes) is None. New reference. */
static PyObject *any_value(Reader r) {
    int kind = 0;
    Reader string = {0};
    uint64_t bits = 0;
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        if (read_tag(&r, &field, &wt) < 0) return NULL;
        if (field == 1 && wt == WT_LEN) {
            if (read_len(&r, &string) < 0) return NULL;
            kind = 1;
        } else if ((field == 2 || field == 3) && wt == WT_VARINT) {
            if (read_varint(&r, &bits) < 0) return NULL;
            kind = (int)field;
        } else if (field == 4 && wt == WT_I64) {
            if (read_fixed64(&r, &bits) < 0) return NULL;
            kind = 4;
        } else {
            if (skip_field(&r, field, wt, 0) < 0) return NULL;
            if (field >= 5 && field <= 7) kind = 0; /* array, kvlist, bytes: not read */
        }
    }
    switch (kind) {
    case 1:
        if (string.end > string.p)
            return PyUnicode_DecodeUTF8((const char *)string.p, string.end - string.p, NULL);
        break;
    case 2:
        if (bits) Py_RETURN_TRUE;
        break;
    case 3:
        if (bits) return PyLong_FromLongLong((long long)bits);
        break;
    case 4: {
        double d;
        memcpy(&d, &bits, sizeof d);
        if (d != 0.0) return PyFloat_FromDouble(d);
        break;
    }
    }
    Py_RETURN_NONE;
}

/* One KeyValue: if its key is wanted, set attrs[key] = value (created on first use). */
static int key_value(Reader r, const Keys *keys, PyObject **attrs) {
    Reader key = {0}, value = {0};
    int has_key = 0;
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        if (read_tag(&r, &field, &wt) < 0) return -1;
        if (field == 1 && wt == WT_LEN) {
            if (read_len(&r, &key) < 0) return -1;
            has_key = 1;
        } else if (field == 2 && wt == WT_LEN) {
            if (read_len(&r, &value) < 0) return -1;
        } else if (skip_field(&r, field, wt, 0) < 0) {
            return -1;
        }
    }
    if (!has_key) return 0;
    Py_ssize_t n = key.end - key.p;
    for (Py_ssize_t i = 0; i < keys->count; i++) {
        if (keys->len[i] == n && memcmp(keys->key[i], key.p, n) == 0) {
            PyObject *v = value.p ? any_value(value) : (Py_INCREF(Py_None), Py_None);
            if (v == NULL) return -1;
            if (*attrs == NULL && (*attrs = PyDict_New()) == NULL) {
                Py_DECREF(v);
                return -1;
            }
            int rc = PyDict_SetItem(*attrs, keys->name[i], v);
            Py_DECREF(v);
            return rc;
        }
    }
    return 0;
}

static int load_keys(PyObject *dict, Keys *keys) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    keys->count = 0;
    if (!PyDict_Check(dict)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a dict of bytes -> str");
        return -1;
    }
    while (PyDict_Next(dict, &pos, &k, &v)) {
        if (keys->count == MAX_KEYS || !PyBytes_Check(k) || !PyUnicode_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "keys must be a dict of at most 32 bytes -> str");
            return -1;
        }
        keys->key[keys->count] = PyBytes_AS_STRING(k);
        keys->len[keys->count] = PyBytes_GET_SIZE(k);
        keys->name[keys->count] = v;
        keys->count++;
    }
    return 0;
}

/* Growable byte buffer for a packed column. */
typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buffer;

/* Room for `n` more bytes. */
static int buffer_reserve(Buffer *b, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + n) cap *= 2;
        char *data = PyMem_Realloc(b->data, cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
        b->cap = cap;
    }
    return 0;
}

static int buffer_put(Buffer *b, const void *src, Py_ssize_t n) {
    if (buffer_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, src, n);
    b->len += n;
    return 0;
}

enum { COL_TRACE, COL_SPAN, COL_PARENT, COL_START, COL_END, COL_STATUS, COL_ORIGIN, N_BUFFERS };

typedef struct {
    PyObject *payload;
    uint64_t latest;
    PyTypeObject *row_type;
    PyObject *origin_of;
    PyObject *stage_key;
    Keys span_keys, resource_keys;
    PyObject *rows, *origins, *names, *stages;
    Buffer col[N_BUFFERS];
    PyObject *bad_span; /* the bytes of the first span that failed the checks */
    PyObject *empty;    /* b"" */
    /* Spans of one trace usually follow each other and a request holds a few dozen span names:
     * the previous span's trace id and the names seen are handed out again instead of new
     * objects (one allocation less each, and their hashes, cached in the object, computed once
     * for the assembler's and the stage table's lookups). */
    PyObject *last_trace_id;
    PyObject *name_cache[NAME_CACHE];
    int name_count;
} Decoder;

static const uint8_t ZERO_ID[16] = {0};

/* Where the spans being decoded come from: set per resource, then per scope (borrowed). */
typedef struct {
    Decoder *d;
    PyObject *origin, *stages, *scope, *resource_attrs;
    int32_t origin_index;
} Sender;

typedef int (*MessageFn)(Sender *s, Reader message);

/* fn on each occurrence of the length-delimited field `wanted`, the other fields skipped.
 * Stops at the first non-zero result: -1 an error, 1 a span that failed the checks. */
static int each_message(Reader r, uint32_t wanted, MessageFn fn, Sender *s) {
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        if (read_tag(&r, &field, &wt) < 0) return -1;
        if (field == wanted && wt == WT_LEN) {
            Reader inner;
            if (read_len(&r, &inner) < 0) return -1;
            int rc = fn(s, inner);
            if (rc != 0) return rc;
        } else if (skip_field(&r, field, wt, 0) < 0) {
            return -1;
        }
    }
    return 0;
}

/* The trace id as bytes: the previous span's object when it is the same id (a new reference). */
static PyObject *trace_id_object(Decoder *d, const uint8_t *id) {
    if (d->last_trace_id != NULL && memcmp(PyBytes_AS_STRING(d->last_trace_id), id, 16) == 0) {
        Py_INCREF(d->last_trace_id);
        return d->last_trace_id;
    }
    PyObject *made = PyBytes_FromStringAndSize((const char *)id, 16);
    if (made == NULL) return NULL;
    Py_XSETREF(d->last_trace_id, made);
    Py_INCREF(made);
    return made;
}

/* The span name as str: one object per distinct name in the request (a new reference). */
static PyObject *name_object(Decoder *d, Reader name) {
    Py_ssize_t len = name.end - name.p;
    for (int i = 0; i < d->name_count; i++) {
        Py_ssize_t cached_len;
        const char *cached = PyUnicode_AsUTF8AndSize(d->name_cache[i], &cached_len);
        if (cached != NULL && cached_len == len && memcmp(cached, name.p, len) == 0) {
            Py_INCREF(d->name_cache[i]);
            return d->name_cache[i];
        }
    }
    PyObject *made = PyUnicode_DecodeUTF8((const char *)name.p, len, NULL);
    if (made != NULL && d->name_count < NAME_CACHE) {
        Py_INCREF(made);
        d->name_cache[d->name_count++] = made;
    }
    return made;
}

/* One Span. 0: decoded; 1: it failed the checks (d->bad_span set); -1: error. */
static int span(Sender *s, Reader r) {
    Decoder *d = s->d;
    PyObject *origin = s->origin, *origin_stages = s->stages, *scope = s->scope;
    int32_t origin_index = s->origin_index;
    const uint8_t *span_start = r.p;
    Reader trace_id = {0}, span_id = {0}, parent = {0}, name = {0}, status;
    uint64_t start = 0, end = 0, code = 0;
    PyObject *attrs = NULL;
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        if (read_tag(&r, &field, &wt) < 0) goto error;
        switch (field) {
        case 1:
            READ_AS(WT_LEN, read_len(&r, &trace_id));
            break;
        case 2:
            READ_AS(WT_LEN, read_len(&r, &span_id));
            break;
        case 4:
            READ_AS(WT_LEN, read_len(&r, &parent));
            break;
        case 5:
            READ_AS(WT_LEN, read_len(&r, &name));
            break;
        case 7:
            READ_AS(WT_I64, read_fixed64(&r, &start));
            break;
        case 8:
            READ_AS(WT_I64, read_fixed64(&r, &end));
            break;
        case 9: {
            Reader kv = {0};
            READ_AS(WT_LEN, read_len(&r, &kv) < 0 ? -1 : key_value(kv, &d->span_keys, &attrs));
            break;
        }
        case 15:
            status.p = status.end = NULL;
            READ_AS(WT_LEN, read_len(&r, &status));
            while (status.p < status.end) {
                uint32_t f;
                int w;
                if (read_tag(&status, &f, &w) < 0) goto error;
                if (f == 3 && w == WT_VARINT) {
                    if (read_varint(&status, &code) < 0) goto error;
                } else if (skip_field(&status, f, w, 0) < 0) {
                    goto error;
                }
            }
            break;
        default:
            if (skip_field(&r, field, wt, 0) < 0) goto error;
        }
    }
    Py_ssize_t parent_len = parent.end - parent.p;
    if (trace_id.end - trace_id.p != 16 || memcmp(trace_id.p, ZERO_ID, 16) == 0 || span_id.end - span_id.p != 8 ||
        memcmp(span_id.p, ZERO_ID, 8) == 0 || (parent_len != 0 && parent_len != 8) || start < MIN_TIME_NS ||
        start > end || end > d->latest) {
        Py_XDECREF(attrs);
        d->bad_span = PyBytes_FromStringAndSize((const char *)span_start, r.end - span_start);
        return d->bad_span == NULL ? -1 : 1;
    }
    if (attrs == NULL && (attrs = PyDict_New()) == NULL) return -1;

    PyObject *row = d->row_type->tp_alloc(d->row_type, ROW_FIELDS);
    if (row == NULL) goto error;
    PyObject *name_str = name_object(d, name);
    if (name_str == NULL) {
        Py_DECREF(row);
        goto error;
    }
    /* Contract spans: the stage from (side, name); others: kvtrace.stage, else the name. */
    PyObject *stage = PyDict_GetItemWithError(origin_stages, name_str);
    if (stage == NULL && !PyErr_Occurred()) stage = PyDict_GetItemWithError(attrs, d->stage_key);
    if (stage == NULL || stage == Py_None) {
        if (PyErr_Occurred()) {
            Py_DECREF(name_str);
            Py_DECREF(row);
            goto error;
        }
        stage = name_str;
    }
    Py_INCREF(stage);
    PyObject *items[ROW_FIELDS] = {
        trace_id_object(d, trace_id.p),
        PyBytes_FromStringAndSize((const char *)span_id.p, 8),
        parent_len ? PyBytes_FromStringAndSize((const char *)parent.p, 8) : (Py_INCREF(d->empty), d->empty),
        name_str,
        PyLong_FromUnsignedLongLong(start),
        PyLong_FromUnsignedLongLong(end),
        PyLong_FromLong((long)(int32_t)code),
        (Py_INCREF(origin), origin),
        stage,
        attrs,
        (Py_INCREF(scope), scope),
        PyBytes_FromStringAndSize((const char *)span_start, r.end - span_start),
    };
    int failed = 0;
    for (int i = 0; i < ROW_FIELDS; i++) {
        if (items[i] == NULL) failed = 1;
        PyTuple_SET_ITEM(row, i, items[i]); /* a NULL item is fine to dealloc */
    }
    int64_t start_i = (int64_t)start, end_i = (int64_t)end;
    int8_t status_i = (int8_t)code;
    if (failed || PyList_Append(d->rows, row) < 0 || PyList_Append(d->names, name_str) < 0 ||
        PyList_Append(d->stages, stage) < 0 || buffer_put(&d->col[COL_TRACE], trace_id.p, 16) < 0 ||
        buffer_put(&d->col[COL_SPAN], span_id.p, 8) < 0 ||
        buffer_put(&d->col[COL_PARENT], parent_len ? parent.p : ZERO_ID, 8) < 0 ||
        buffer_put(&d->col[COL_START], &start_i, 8) < 0 || buffer_put(&d->col[COL_END], &end_i, 8) < 0 ||
        buffer_put(&d->col[COL_STATUS], &status_i, 1) < 0 ||
        buffer_put(&d->col[COL_ORIGIN], &origin_index, 4) < 0) {
        Py_DECREF(row);
        return -1;
    }
    /* A row refers to nothing that could refer back to it, so it can never be part of a
     * cycle: untracked, the cyclic GC does not walk the rows again and again while they
     * wait in the assembler and the store's buffer (it cost ~10% of the collector's CPU). */
    PyObject_GC_UnTrack(row);
    Py_DECREF(row);
    return 0;
error:
    Py_XDECREF(attrs);
    return -1;
}

/* The first pass over a message's fields: concatenate every occurrence of `field` (a
 * message field occurring twice merges, which for our purposes is concatenation). */
static PyObject *collect(Reader r, uint32_t wanted) {
    PyObject *out = NULL;
    while (r.p < r.end) {
        uint32_t field;
        int wt;
        if (read_tag(&r, &field, &wt) < 0) goto error;
        if (field == wanted && wt == WT_LEN) {
            Reader inner;
            if (read_len(&r, &inner) < 0) goto error;
            PyObject *part = PyBytes_FromStringAndSize((const char *)inner.p, inner.end - inner.p);
            if (part == NULL) goto error;
            if (out == NULL) {
                out = part;
            } else {
                PyBytes_ConcatAndDel(&out, part);
                if (out == NULL) goto error;
            }
        } else if (skip_field(&r, field, wt, 0) < 0) {
            goto error;
        }
    }
    return out != NULL ? out : PyBytes_FromStringAndSize("", 0);
error:
    Py_XDECREF(out);
    return NULL;
}

static int scope_spans(Sender *s, Reader r) {
    PyObject *scope = collect(r, 1);
    if (scope == NULL) return -1;
    s->scope = scope;
    int rc = each_message(r, 2, span, s);
    Py_DECREF(scope);
    return rc;
}

static int resource_attribute(Sender *s, Reader kv) {
    return key_value(kv, &s->d->resource_keys, &s->resource_attrs);
}

static int resource_spans(Sender *s, Reader r) {
    Decoder *d = s->d;
    PyObject *resource = collect(r, 1), *origin = NULL, *stages = NULL;
    int rc = -1;
    if (resource == NULL) return -1;
    s->resource_attrs = NULL;
    Reader res = {(const uint8_t *)PyBytes_AS_STRING(resource),
                  (const uint8_t *)PyBytes_AS_STRING(resource) + PyBytes_GET_SIZE(resource)};
    if (each_message(res, 1, resource_attribute, s) < 0) goto done;
    if (s->resource_attrs == NULL && (s->resource_attrs = PyDict_New()) == NULL) goto done;
    origin = PyObject_CallFunctionObjArgs(d->origin_of, s->resource_attrs, resource, NULL);
    if (origin == NULL) goto done;
    stages = PyObject_GetAttrString(origin, "stages");
    if (stages == NULL) goto done;
    if (!PyDict_Check(stages)) {
        PyErr_SetString(PyExc_TypeError, "Origin.stages must be a dict");
        goto done;
    }
    s->origin = origin;
    s->stages = stages;
    s->origin_index = (int32_t)PyList_GET_SIZE(d->origins);
    if (PyList_Append(d->origins, origin) < 0) goto done;
    rc = each_message(r, 2, scope_spans, s);
done:
    Py_DECREF(resource);
    Py_CLEAR(s->resource_attrs);
    Py_XDECREF(origin);
    Py_XDECREF(stages);
    return rc;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Decoder d;
    memset(&d, 0, sizeof d);
    PyObject *span_keys, *resource_keys, *result = NULL;
    Py_buffer view;
    unsigned long long latest;
    if (!PyArg_ParseTuple(args, "y*KO!OO!O!U:decode", &view, &latest, &PyType_Type, &d.row_type, &d.origin_of,
                          &PyDict_Type, &span_keys, &PyDict_Type, &resource_keys, &d.stage_key))
        return NULL;
    d.latest = latest;
    if (!PyType_IsSubtype(d.row_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "row_type must be a tuple subclass");
        goto done;
    }
    if (load_keys(span_keys, &d.span_keys) < 0 || load_keys(resource_keys, &d.resource_keys) < 0) goto done;
    d.rows = PyList_New(0);
    d.origins = PyList_New(0);
    d.names = PyList_New(0);
    d.stages = PyList_New(0);
    d.empty = PyBytes_FromStringAndSize("", 0);
    if (!d.rows || !d.origins || !d.names || !d.stages || !d.empty) goto done;

    Reader r = {(const uint8_t *)view.buf, (const uint8_t *)view.buf + view.len};
    Sender sender = {&d};
    int rc = each_message(r, 1, resource_spans, &sender);
    if (rc < 0) goto done;
    if (rc == 1) {
        result = Py_BuildValue("(OOO)", Py_None, d.bad_span, Py_None);
        goto done;
    }
    PyObject *cols[N_BUFFERS];
    int ok = 1;
    for (int i = 0; i < N_BUFFERS; i++) {
        cols[i] = PyBytes_FromStringAndSize(d.col[i].data ? d.col[i].data : "", d.col[i].len);
        if (cols[i] == NULL) ok = 0;
    }
    if (ok) {
        result = Py_BuildValue("(OO(OOOOOOOOO))", d.rows, d.origins, cols[COL_TRACE], cols[COL_SPAN],
                               cols[COL_PARENT], cols[COL_START], cols[COL_END], cols[COL_STATUS],
                               cols[COL_ORIGIN], d.names, d.stages);
    }
    for (int i = 0; i < N_BUFFERS; i++) Py_XDECREF(cols[i]);
done:
    for (int i = 0; i < N_BUFFERS; i++) PyMem_Free(d.col[i].data);
    Py_XDECREF(d.rows);
    Py_XDECREF(d.origins);
    Py_XDECREF(d.names);
    Py_XDECREF(d.stages);
    Py_XDECREF(d.empty);
    Py_XDECREF(d.bad_span);
    Py_XDECREF(d.last_trace_id);
    for (int i = 0; i < d.name_count; i++) Py_DECREF(d.name_cache[i]);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------------ encoding */

/* `value` as a varint at `out` (room for 10 bytes); returns the end. */
static uint8_t *write_varint(uint8_t *out, uint64_t value) {
    while (value > 0x7F) {
        *out++ = (uint8_t)(value & 0x7F) | 0x80;
        value >>= 7;
    }
    *out++ = (uint8_t)value;
    return out;
}

static int varint_size(uint64_t value) {
    int n = 1;
    while (value > 0x7F) {
        value >>= 7;
        n++;
    }
    return n;
}

/* One KeyValue entry of Span.attributes: 0x4a len { 0x0a len key, 0x12 len AnyValue }. */
static int put_attribute(Buffer *b, PyObject *key, PyObject *value) {
    Py_ssize_t key_len, text_len = 0;
    const char *key_utf8 = PyUnicode_AsUTF8AndSize(key, &key_len), *text = NULL;
    if (key_utf8 == NULL) return -1;
    uint8_t scalar[11]; /* a tag and a 10-byte varint at most */
    Py_ssize_t any_len; /* the AnyValue's length */
    if (PyBool_Check(value)) {
        scalar[0] = 0x10; /* bool_value */
        scalar[1] = value == Py_True;
        any_len = 2;
    } else if (PyLong_Check(value)) {
        uint64_t v = PyLong_AsUnsignedLongLongMask(value);
        if (v == (uint64_t)-1 && PyErr_Occurred()) return -1;
        scalar[0] = 0x18; /* int_value */
        any_len = write_varint(scalar + 1, v) - scalar;
    } else if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        scalar[0] = 0x21; /* double_value, little-endian fixed64 */
        uint64_t bits;
        memcpy(&bits, &d, 8);
        for (int i = 0; i < 8; i++) scalar[1 + i] = (uint8_t)(bits >> (8 * i));
        any_len = 9;
    } else if (PyUnicode_Check(value)) {
        text = PyUnicode_AsUTF8AndSize(value, &text_len);
        if (text == NULL) return -1;
        any_len = 1 + varint_size((uint64_t)text_len) + text_len; /* string_value */
    } else {
        PyErr_Format(PyExc_TypeError, "attribute %R: a str, bool, int or float, not %.100s", key,
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    Py_ssize_t body = 1 + varint_size((uint64_t)key_len) + key_len + 1 + varint_size((uint64_t)any_len) + any_len;
    /* room for the whole entry, then written in place (a buffer_put per byte or varint cost ~30 % more) */
    if (buffer_reserve(b, 1 + varint_size((uint64_t)body) + body) < 0) return -1;
    uint8_t *out = (uint8_t *)b->data + b->len;
    *out++ = 0x4a; /* Span.attributes */
    out = write_varint(out, (uint64_t)body);
    *out++ = 0x0a; /* KeyValue.key */
    out = write_varint(out, (uint64_t)key_len);
    memcpy(out, key_utf8, key_len);
    out += key_len;
    *out++ = 0x12; /* KeyValue.value */
    out = write_varint(out, (uint64_t)any_len);
    if (text == NULL) {
        memcpy(out, scalar, any_len);
        out += any_len;
    } else {
        *out++ = 0x0a; /* AnyValue.string_value */
        out = write_varint(out, (uint64_t)text_len);
        memcpy(out, text, text_len);
        out += text_len;
    }
    b->len = (char *)out - b->data;
    return 0;
}

static PyObject *attributes(PyObject *self, PyObject *args) {
    PyObject *keys, *values;
    if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &keys, &values)) return NULL;
    PyObject *seq = PySequence_Fast(values, "values: a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "%zd keys, %zd values", n, PySequence_Fast_GET_SIZE(seq));
    }
    Buffer b = {NULL, 0, 0};
    PyObject *result = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PySequence_Fast_GET_ITEM(seq, i);
        if (value != Py_None && put_attribute(&b, PyTuple_GET_ITEM(keys, i), value) < 0) goto done;
    }
    result = PyBytes_FromStringAndSize(b.data ? b.data : "", b.len);
done:
    PyMem_Free(b.data);
    Py_DECREF(seq);
    return result;
}

static int put_int64(Buffer *b, int64_t value) { return buffer_put(b, &value, 8); }

/* PyLong_AsLongLong without its detour through a byte array for ints of more than one digit
 * (every time in ns): -1 with TypeError/OverflowError set where `value` is no int64. */
static int as_int64(PyObject *value, int64_t *out) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "a time beyond int64");
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* The Breakdown fields read here, as interned str (made at import: a name made per call cost more than
 * its lookup). */
enum {
    F_COMPLETE, F_CRITICAL_NS, F_DECODE_INSTANCE, F_ERROR, F_ERROR_STAGE, F_ERROR_TYPE, F_MISSING, F_PARTS,
    F_PREFILL_INSTANCE, F_PROMPT_TOKENS, F_RENDEZVOUS_ORDER, F_SEGMENTS, F_START_NS, F_TIMINGS, F_TRANSFER_BYTES,
    F_TTFT_NS, N_FIELDS
};
static const char *const FIELD_NAMES[N_FIELDS] = {
    "complete", "critical_ns", "decode_instance", "error", "error_stage", "error_type", "missing", "parts",
    "prefill_instance", "prompt_tokens", "rendezvous_order", "segments", "start_ns", "timings", "transfer_bytes",
    "ttft_ns"};
static PyObject *fields[N_FIELDS];

static PyObject *field(PyObject *b, int which) { return PyObject_GetAttr(b, fields[which]); }

static PyObject *origin_instance, *origin_side, *origin_mode; /* interned attribute names of model.Origin */
static PyObject *empty_mode; /* "": a trace's mode until a sender names one */

/* The names above, made once when the module is imported. */
static int intern_names(void) {
    for (int i = 0; i < N_FIELDS; i++)
        if ((fields[i] = PyUnicode_InternFromString(FIELD_NAMES[i])) == NULL) return -1;
    if ((origin_instance = PyUnicode_InternFromString("instance")) == NULL ||
        (origin_side = PyUnicode_InternFromString("side")) == NULL ||
        (origin_mode = PyUnicode_InternFromString("mode")) == NULL || (empty_mode = PyUnicode_FromString("")) == NULL)
        return -1;
    return 0;
}

static PyObject *stage_columns(PyObject *self, PyObject *args) {
    PyObject *breakdowns, *known;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &breakdowns, &PyDict_Type, &known)) return NULL;
    enum { IDS, STARTS, ENDS, CRITICAL, OFFSETS, N_COLUMNS };
    Buffer col[N_COLUMNS] = {{0}};
    PyObject *unknown = PyList_New(0), *unknown_seen = PyDict_New(), *result = NULL;
    if (!unknown || !unknown_seen) goto done;
    int32_t count = 0;
    if (buffer_put(&col[OFFSETS], &count, 4) < 0) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(breakdowns); i++) {
        PyObject *b = PyList_GET_ITEM(breakdowns, i);
        PyObject *timings = field(b, F_TIMINGS);
        PyObject *critical = timings ? field(b, F_CRITICAL_NS) : NULL;
        if (critical == NULL || !PyDict_Check(timings) || !PyDict_Check(critical)) {
            if (critical != NULL) PyErr_SetString(PyExc_TypeError, "timings and critical_ns must be dicts");
            Py_XDECREF(timings);
            Py_XDECREF(critical);
            goto done;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *timing;
        int failed = 0;
        while (!failed && PyDict_Next(timings, &pos, &key, &timing)) {
            PyObject *id = PyDict_GetItemWithError(known, key);
            PyObject *on_path = id || !PyErr_Occurred() ? PyDict_GetItemWithError(critical, key) : NULL;
            if (PyErr_Occurred() || !PyTuple_Check(timing) || PyTuple_GET_SIZE(timing) < 2) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a timing must be (start, end, ...)");
                failed = 1;
                break;
            }
            int64_t id_value = -1, start, end, path = 0;
            if (id != NULL) {
                if (as_int64(id, &id_value) < 0) failed = 1;
            } else if (!PyDict_Contains(unknown_seen, key)) {
                if (PyDict_SetItem(unknown_seen, key, Py_None) < 0 || PyList_Append(unknown, key) < 0) failed = 1;
            }
            if (failed || as_int64(PyTuple_GET_ITEM(timing, 0), &start) < 0 ||
                as_int64(PyTuple_GET_ITEM(timing, 1), &end) < 0 || (on_path != NULL && as_int64(on_path, &path) < 0) ||
                put_int64(&col[IDS], id_value) < 0 || put_int64(&col[STARTS], start) < 0 ||
                put_int64(&col[ENDS], end) < 0 || put_int64(&col[CRITICAL], path) < 0)
                failed = 1;
            count++;
        }
        Py_DECREF(timings);
        Py_DECREF(critical);
        if (failed || buffer_put(&col[OFFSETS], &count, 4) < 0) goto done;
    }
    PyObject *packed[N_COLUMNS] = {NULL};
    int ok = 1;
    for (int c = 0; c < N_COLUMNS; c++) {
        packed[c] = PyBytes_FromStringAndSize(col[c].data ? col[c].data : "", col[c].len);
        if (packed[c] == NULL) ok = 0;
    }
    if (ok)
        result = PyTuple_Pack(6, packed[IDS], packed[STARTS], packed[ENDS], packed[CRITICAL], packed[OFFSETS], unknown);
    for (int c = 0; c < N_COLUMNS; c++) Py_XDECREF(packed[c]);
done:
    for (int c = 0; c < N_COLUMNS; c++) PyMem_Free(col[c].data);
    Py_XDECREF(unknown);
    Py_XDECREF(unknown_seen);
    return result;
}


/* How number_columns turns a field's value into its column (store.MS, INT64, INT32, MICROSECONDS, in that order). */
enum { K_MS, K_INT64, K_INT32, K_MICROSECONDS };

/* The requests' numeric columns (store.NUMBER_COLUMNS), each packed end to end: spec is a tuple of
 * (field name, part key or None, kind); a part key reads breakdown.parts.get(key, 0). K_MS: ns / 1e6 as
 * a double; K_INT64, K_INT32: the int as it is (OverflowError past its type); K_MICROSECONDS: ns // 1000.
 * TypeError for a value that is no int: the caller then builds the columns in Python. */
static PyObject *number_columns(PyObject *self, PyObject *args) {
    PyObject *breakdowns, *spec;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &breakdowns, &PyTuple_Type, &spec)) return NULL;
    Py_ssize_t n_columns = PyTuple_GET_SIZE(spec), n = PyList_GET_SIZE(breakdowns);
    PyObject **names = PyMem_Calloc(n_columns ? n_columns : 1, sizeof(PyObject *));
    PyObject **parts = PyMem_Calloc(n_columns ? n_columns : 1, sizeof(PyObject *));
    int *kinds = PyMem_Calloc(n_columns ? n_columns : 1, sizeof(int));
    char **data = PyMem_Calloc(n_columns ? n_columns : 1, sizeof(char *));
    PyObject *result = NULL;
    if (!names || !parts || !kinds || !data) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < n_columns; c++) {
        PyObject *entry = PyTuple_GET_ITEM(spec, c);
        if (!PyArg_ParseTuple(entry, "UOi", &names[c], &parts[c], &kinds[c])) goto done;
        if (kinds[c] < K_MS || kinds[c] > K_MICROSECONDS) {
            PyErr_SetString(PyExc_ValueError, "unknown column kind");
            goto done;
        }
        if ((data[c] = PyMem_Malloc(n ? n * 8 : 1)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(breakdowns, i), *part_dict = NULL;
        int failed = 0;
        for (Py_ssize_t c = 0; c < n_columns; c++) {
            PyObject *value;
            if (parts[c] != Py_None) {
                if (part_dict == NULL) { /* read once per breakdown, at its first part column */
                    if ((part_dict = field(b, F_PARTS)) != NULL && !PyDict_Check(part_dict))
                        PyErr_SetString(PyExc_TypeError, "parts must be a dict");
                    if (PyErr_Occurred()) {
                        failed = 1;
                        break;
                    }
                }
                value = PyDict_GetItemWithError(part_dict, parts[c]);
                if (value == NULL && PyErr_Occurred()) {
                    failed = 1;
                    break;
                }
                Py_XINCREF(value);  /* absent: 0 */
            } else if ((value = PyObject_GetAttr(b, names[c])) == NULL) {
                failed = 1;
                break;
            }
            int64_t v = 0;
            if (value != NULL) {
                if (!PyLong_Check(value) || PyBool_Check(value)) {
                    PyErr_SetString(PyExc_TypeError, "a numeric field that is no int");
                    failed = 1;
                } else if (as_int64(value, &v) < 0) {
                    failed = 1;
                }
                Py_DECREF(value);
                if (failed) break;
            }
            char *at = data[c] + (kinds[c] == K_INT32 ? 4 : 8) * i;
            if (kinds[c] == K_MS) {
                double ms = (double)v / 1e6;
                memcpy(at, &ms, 8);
            } else if (kinds[c] == K_INT32) {
                if (v < INT32_MIN || v > INT32_MAX) {
                    PyErr_SetString(PyExc_OverflowError, "a count beyond int32");
                    failed = 1;
                    break;
                }
                int32_t small = (int32_t)v;
                memcpy(at, &small, 4);
            } else {
                if (kinds[c] == K_MICROSECONDS) v = v / 1000 - (v % 1000 < 0);  /* floor, as Python's // */
                memcpy(at, &v, 8);
            }
        }
        Py_XDECREF(part_dict);
        if (failed) goto done;
    }
    if ((result = PyList_New(n_columns)) == NULL) goto done;
    for (Py_ssize_t c = 0; c < n_columns; c++) {
        PyObject *packed = PyBytes_FromStringAndSize(data[c], (kinds[c] == K_INT32 ? 4 : 8) * n);
        if (packed == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, c, packed);
    }
done:
    if (data)
        for (Py_ssize_t c = 0; c < n_columns; c++) PyMem_Free(data[c]);
    PyMem_Free(data);
    PyMem_Free(names);
    PyMem_Free(parts);
    PyMem_Free(kinds);
    return result;
}


/* ------------------------------------------------------------------ the critical-path walk */

typedef struct {
    PyObject *timings, *graph, *derived, *root;
} Walk;

/* A timing's (start, end, category), or -1 with TypeError/OverflowError set. */
static int unpack_timing(PyObject *timing, int64_t *start, int64_t *end, PyObject **category) {
    if (!PyTuple_Check(timing) || PyTuple_GET_SIZE(timing) != 3) {
        PyErr_SetString(PyExc_TypeError, "a timing must be (start, end, category)");
        return -1;
    }
    if (as_int64(PyTuple_GET_ITEM(timing, 0), start) < 0 || as_int64(PyTuple_GET_ITEM(timing, 1), end) < 0)
        return -1;
    if (category != NULL) *category = PyTuple_GET_ITEM(timing, 2);
    return 0;
}

static int timing_end(PyObject *timing, int64_t *end) {
    int64_t start;
    return unpack_timing(timing, &start, end, NULL);
}

static int extend(PyObject *list, PyObject *items) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n, n, items);
}

/* attribution._latest_present: for a stage the trace lacks, the one of the stages it waits for
 * (bridging those it lacks too, breadth first) that ended last. A new reference, NULL without an
 * error where none is there. */
static PyObject *latest_present(Walk *w, PyObject *missing) {
    PyObject *queue = PyList_New(0), *seen = PySet_New(NULL), *best = NULL;
    int64_t best_end = 0;
    if (queue == NULL || seen == NULL || PySet_Add(seen, missing) < 0) goto fail;
    PyObject *first = PyDict_GetItemWithError(w->graph, missing);
    if (first == NULL ? PyErr_Occurred() != NULL : extend(queue, first) < 0) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(queue); i++) {
        PyObject *key = PyList_GET_ITEM(queue, i);
        int known = PySet_Contains(seen, key);
        if (known < 0) goto fail;
        if (known) continue;
        if (PySet_Add(seen, key) < 0) goto fail;
        PyObject *found = PyDict_GetItemWithError(w->timings, key);
        if (found == NULL) {
            if (PyErr_Occurred()) goto fail;
            int derived = PySet_Contains(w->derived, key);
            if (derived < 0) goto fail;
            if (derived) continue;
            PyObject *next = PyDict_GetItemWithError(w->graph, key);
            if (next == NULL) {
                if (PyErr_Occurred()) goto fail;
                continue;
            }
            if (extend(queue, next) < 0) goto fail;
            continue;
        }
        int64_t end;
        if (timing_end(found, &end) < 0) goto fail;
        if (best == NULL || end > best_end) {
            Py_INCREF(key);
            Py_XSETREF(best, key);
            best_end = end;
        }
    }
    Py_DECREF(queue);
    Py_DECREF(seen);
    return best;
fail:
    Py_XDECREF(queue);
    Py_XDECREF(seen);
    Py_XDECREF(best);
    return NULL;
}

/* The off-graph case: every stage that ended before `node_start`, but the node and the root. */
static PyObject *ended_before(Walk *w, PyObject *node_key, int64_t node_start) {
    PyObject *preds = PyList_New(0), *key, *timing;
    Py_ssize_t pos = 0;
    if (preds == NULL) return NULL;
    while (PyDict_Next(w->timings, &pos, &key, &timing)) {
        int same = PyObject_RichCompareBool(key, node_key, Py_EQ);
        int root = same ? 0 : PyObject_RichCompareBool(key, w->root, Py_EQ);
        int64_t end;
        if (same < 0 || root < 0 || timing_end(timing, &end) < 0) goto fail;
        if (!same && !root && end <= node_start && PyList_Append(preds, key) < 0) goto fail;
    }
    return preds;
fail:
    Py_DECREF(preds);
    return NULL;
}

static int add_segment(PyObject *segments, PyObject *key, int64_t start, int64_t end) {
    PyObject *segment = PyTuple_New(3), *start_ns = PyLong_FromLongLong(start), *end_ns = PyLong_FromLongLong(end);
    if (segment == NULL || start_ns == NULL || end_ns == NULL) {
        Py_XDECREF(segment);
        Py_XDECREF(start_ns);
        Py_XDECREF(end_ns);
        return -1;
    }
    Py_INCREF(key);
    PyTuple_SET_ITEM(segment, 0, key);
    PyTuple_SET_ITEM(segment, 1, start_ns);
    PyTuple_SET_ITEM(segment, 2, end_ns);
    int failed = PyList_Append(segments, segment) < 0;
    Py_DECREF(segment);
    return failed ? -1 : 0;
}

#define MAX_CATEGORIES 16

static PyObject *walk(PyObject *self, PyObject *args) {
    Walk w;
    PyObject *config, *names, *gap, *coordination, *unattributed, *first_keys;
    long long start, end;
    if (!PyArg_ParseTuple(args, "O!O!LLO!", &PyDict_Type, &w.timings, &PyDict_Type, &w.graph, &start, &end,
                          &PyTuple_Type, &config))
        return NULL;
    if (!PyArg_ParseTuple(config, "O!OOO!UUO!", &PyFrozenSet_Type, &w.derived, &w.root, &gap, &PyTuple_Type,
                          &names, &coordination, &unattributed, &PyTuple_Type, &first_keys))
        return NULL;
    Py_ssize_t n_names = PyTuple_GET_SIZE(names);
    if (n_names > MAX_CATEGORIES) {
        PyErr_SetString(PyExc_ValueError, "too many categories");
        return NULL;
    }
    int64_t parts[MAX_CATEGORIES] = {0}, width;
    if (__builtin_sub_overflow((int64_t)end, (int64_t)start, &width)) {
        PyErr_SetString(PyExc_OverflowError, "end - start beyond int64");
        return NULL;
    }
    int unattributed_at = -1, coordination_at = -1;
    for (Py_ssize_t c = 0; c < n_names; c++) {
        if (PyUnicode_Compare(PyTuple_GET_ITEM(names, c), unattributed) == 0) unattributed_at = (int)c;
        if (PyUnicode_Compare(PyTuple_GET_ITEM(names, c), coordination) == 0) coordination_at = (int)c;
    }
    if (PyErr_Occurred()) return NULL;
    if (unattributed_at < 0 || coordination_at < 0) {
        PyErr_SetString(PyExc_ValueError, "the unattributed and coordination categories must be named");
        return NULL;
    }
    PyObject *critical = PyDict_New(), *segments = PyList_New(0), *result = NULL, *node_key = NULL, *preds = NULL;
    if (critical == NULL || segments == NULL) goto done;
    if (end > start) {
        /* the first token back at the router, else out of D's API server, else sampled */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(first_keys) && node_key == NULL; i++) {
            int has = PyDict_Contains(w.timings, PyTuple_GET_ITEM(first_keys, i));
            if (has < 0) goto done;
            if (has || i == PyTuple_GET_SIZE(first_keys) - 1) node_key = PyTuple_GET_ITEM(first_keys, i);
        }
        if (node_key != NULL) {
            int has = PyDict_Contains(w.timings, node_key);
            if (has < 0) goto done;
            if (!has) { /* no first token: start from whatever ended last (the first of equals) */
                PyObject *key, *timing;
                Py_ssize_t pos = 0;
                int64_t latest = 0;
                node_key = NULL;
                while (PyDict_Next(w.timings, &pos, &key, &timing)) {
                    int root = PyObject_RichCompareBool(key, w.root, Py_EQ);
                    int64_t key_end;
                    if (root < 0 || timing_end(timing, &key_end) < 0) goto done;
                    if (!root && (node_key == NULL || key_end > latest)) {
                        node_key = key;
                        latest = key_end;
                    }
                }
            }
        }
        Py_XINCREF(node_key);
    }
    int64_t t = end;
    Py_ssize_t steps = PyDict_GET_SIZE(w.timings); /* each stage once at most (walk_python says why) */
    while (node_key != NULL && t > start && steps-- > 0) {
        PyObject *timing = PyDict_GetItemWithError(w.timings, node_key), *category;
        int64_t node_start, node_end;
        if (timing == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, node_key);
            goto done;
        }
        if (unpack_timing(timing, &node_start, &node_end, &category) < 0) goto done;
        preds = PyDict_GetItemWithError(w.graph, node_key);
        if (preds != NULL) {
            preds = PySequence_Fast(preds, "predecessors must be a sequence");
        } else if (!PyErr_Occurred()) { /* off the known graph: anything that ended before it (but the root) */
            preds = ended_before(&w, node_key, node_start);
        }
        if (preds == NULL) goto done;
        PyObject *pred_key = NULL;
        int64_t pred_end = start;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(preds); i++) { /* the one that ended last */
            PyObject *key = PySequence_Fast_GET_ITEM(preds, i), *bridged = NULL;
            PyObject *candidate = PyDict_GetItemWithError(w.timings, key);
            if (candidate == NULL) { /* not in this trace: bridge to what it waits for */
                if (PyErr_Occurred()) goto walk_failed;
                int derived = PySet_Contains(w.derived, key);
                if (derived < 0) goto walk_failed;
                if (derived) continue;
                bridged = latest_present(&w, key);
                if (bridged == NULL) {
                    if (PyErr_Occurred()) goto walk_failed;
                    continue;
                }
                key = bridged;
                candidate = PyDict_GetItem(w.timings, key);
            }
            int64_t candidate_end;
            if (timing_end(candidate, &candidate_end) < 0) {
                Py_XDECREF(bridged);
                goto walk_failed;
            }
            if (pred_key == NULL || candidate_end > pred_end) {
                Py_INCREF(key);
                Py_XSETREF(pred_key, key);
                pred_end = candidate_end;
            }
            Py_XDECREF(bridged);
            continue;
        walk_failed:
            Py_XDECREF(pred_key);
            goto done;
        }
        Py_CLEAR(preds);
        /* This stage's segment: from when its last predecessor ended (or it started, if later) to
         * when it ended (or t, if the walk is already earlier), within [start, t]. */
        int64_t seg_end = node_end < t ? node_end : t;
        if (seg_end < start) seg_end = start;
        int64_t seg_start = node_start > pred_end ? node_start : pred_end;
        if (seg_start < start) seg_start = start;
        if (seg_start > seg_end) seg_start = seg_end;
        if (seg_end < t) {
            parts[unattributed_at] += t - seg_end;
            if (add_segment(segments, gap, seg_end, t) < 0) goto step_failed;
        }
        if (seg_end > seg_start) {
            int at = coordination_at; /* "root" on a span that is not the router's root */
            for (Py_ssize_t c = 0; c < n_names; c++) {
                PyObject *name = PyTuple_GET_ITEM(names, c);
                if (name == category || (PyUnicode_Check(category) && PyUnicode_Compare(name, category) == 0)) {
                    at = (int)c;
                    break;
                }
            }
            PyObject *on_path = PyLong_FromLongLong(seg_end - seg_start);
            int failed = on_path == NULL || PyDict_SetItem(critical, node_key, on_path) < 0;
            Py_XDECREF(on_path);
            if (failed || add_segment(segments, node_key, seg_start, seg_end) < 0) goto step_failed;
            parts[at] += seg_end - seg_start;
        }
        t = seg_start;
        Py_SETREF(node_key, pred_key);
        continue;
    step_failed:
        Py_XDECREF(pred_key);
        goto done;
    }
    if (t > start) {
        parts[unattributed_at] += t - start;
        if (add_segment(segments, gap, start, t) < 0) goto done;
    }
    if (PyList_Reverse(segments) < 0) goto done;
    PyObject *by_name = PyDict_New();
    if (by_name == NULL) goto done;
    for (Py_ssize_t c = 0; c < n_names; c++) {
        PyObject *ns = PyLong_FromLongLong(parts[c]);
        int failed = ns == NULL || PyDict_SetItem(by_name, PyTuple_GET_ITEM(names, c), ns) < 0;
        Py_XDECREF(ns);
        if (failed) {
            Py_DECREF(by_name);
            goto done;
        }
    }
    result = PyTuple_Pack(3, by_name, critical, segments);
    Py_DECREF(by_name);
done:
    Py_XDECREF(node_key);
    Py_XDECREF(preds);
    Py_XDECREF(critical);
    Py_XDECREF(segments);
    return result;
}

/* ------------------------------------------------------------------ a trace's spans, indexed */

/* model.SpanRow's fields read here */
enum { ROW_NAME = 3, ROW_START = 4, ROW_END = 5, ROW_STATUS = 6, ROW_ORIGIN = 7, ROW_STAGE = 8, ROW_ATTRS = 9 };


/* An Origin's instance, side and mode (new references); spans of one sender share their Origin. */
typedef struct {
    PyObject *origin, *instance, *side, *mode;
} SpanOrigin;

static void span_origin_clear(SpanOrigin *s) {
    Py_CLEAR(s->instance);
    Py_CLEAR(s->side);
    Py_CLEAR(s->mode);
    s->origin = NULL;
}

static int span_origin_of(SpanOrigin *s, PyObject *origin) {
    if (origin == s->origin) return 0;
    span_origin_clear(s);
    if ((s->instance = PyObject_GetAttr(origin, origin_instance)) == NULL ||
        (s->side = PyObject_GetAttr(origin, origin_side)) == NULL ||
        (s->mode = PyObject_GetAttr(origin, origin_mode)) == NULL)
        return -1;
    s->origin = origin;
    return 0;
}

static int earlier(PyObject *span, PyObject *than) {
    return PyObject_RichCompareBool(PyTuple_GET_ITEM(span, ROW_START), PyTuple_GET_ITEM(than, ROW_START), Py_LT);
}

static PyObject *instance_of_row(PyObject *span) { /* a new reference */
    return PyObject_GetAttr(PyTuple_GET_ITEM(span, ROW_ORIGIN), origin_instance);
}

/*   index_spans(spans, config) -> (index, first_of, ranks, failed, mode, p_any, d_any, client)
 *
 * attribution.index_spans_python, step for step (the reference; the tests hold the two to the same
 * output). config = attribution._INDEX_CONFIG: (client span name, STAGE_KEYS, contract sides, P's
 * side, D's side). */
static PyObject *index_spans(PyObject *self, PyObject *args) {
    PyObject *spans, *config, *client_name, *stage_keys, *contract_sides, *prefill, *decode;
    if (!PyArg_ParseTuple(args, "OO!", &spans, &PyTuple_Type, &config)) return NULL;
    if (!PyArg_ParseTuple(config, "UO!O!UU", &client_name, &PyDict_Type, &stage_keys, &PyFrozenSet_Type,
                          &contract_sides, &prefill, &decode))
        return NULL;
    PyObject *rows = PySequence_Fast(spans, "spans must be a sequence"), *result = NULL, *key = NULL;
    if (rows == NULL) return NULL;
    PyObject *index = PyDict_New(), *first_of = PyDict_New(), *ranks = PyDict_New();
    /* borrowed: the spans, their Origins (mode) and config (the empty mode) hold them */
    PyObject *failed = Py_None, *mode = empty_mode, *p_any = Py_None, *d_any = Py_None, *client = Py_None;
    SpanOrigin sender = {0};
    if (index == NULL || first_of == NULL || ranks == NULL) goto done;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(rows); i++) {
        PyObject *span = PySequence_Fast_GET_ITEM(rows, i);
        if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) < ROW_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "a span must be a model.SpanRow");
            goto done;
        }
        int is_client = PyObject_RichCompareBool(PyTuple_GET_ITEM(span, ROW_NAME), client_name, Py_EQ);
        if (is_client < 0) goto done;
        if (is_client) { /* the load generator's view: read, but not a stage */
            client = span;
            continue;
        }
        if (span_origin_of(&sender, PyTuple_GET_ITEM(span, ROW_ORIGIN)) < 0) goto done;
        PyObject *known = PyDict_GetItemWithError(first_of, sender.instance);
        if (known == NULL && PyErr_Occurred()) goto done;
        int is_earlier = known == NULL ? 1 : earlier(span, known);
        if (is_earlier < 0 || (is_earlier && PyDict_SetItem(first_of, sender.instance, span) < 0)) goto done;
        Py_XSETREF(key, PyTuple_Pack(2, sender.side, PyTuple_GET_ITEM(span, ROW_STAGE)));
        if (key == NULL) goto done;
        PyObject *same = PyDict_GetItemWithError(stage_keys, key); /* the contract's object for it */
        if (same == NULL && PyErr_Occurred()) goto done;
        if (same != NULL) Py_SETREF(key, Py_NewRef(same));
        PyObject *seen = PyDict_GetItemWithError(index, key);
        if (seen == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(index, key, span) < 0) goto done;
        } else {
            PyObject *seen_instance = instance_of_row(seen);
            if (seen_instance == NULL) goto done;
            int one_process = PyObject_RichCompareBool(seen_instance, sender.instance, Py_EQ), contract = 1, ranked;
            if (one_process == 0) contract = PySet_Contains(contract_sides, sender.side);
            ranked = one_process < 0 || contract < 0 ? -1 : PyDict_Contains(ranks, key);
            if (ranked < 0) {
                Py_DECREF(seen_instance);
                goto done;
            }
            if ((one_process || !contract) && !ranked) { /* a stage repeated (preemption): its first time counts */
                Py_DECREF(seen_instance);
                int first = earlier(span, seen);
                if (first < 0 || (first && PyDict_SetItem(index, key, span) < 0)) goto done;
            } else { /* another process of the side recorded it too (a TP rank): keep each one's first */
                PyObject *by_rank = PyDict_GetItemWithError(ranks, key);
                if (by_rank == NULL) {
                    if (PyErr_Occurred() || (by_rank = PyDict_New()) == NULL) {
                        Py_DECREF(seen_instance);
                        goto done;
                    }
                    int stored = PyDict_SetItem(by_rank, seen_instance, seen);
                    if (stored == 0) stored = PyDict_SetItem(ranks, key, by_rank);
                    Py_DECREF(by_rank); /* ranks holds it */
                    if (stored < 0) {
                        Py_DECREF(seen_instance);
                        goto done;
                    }
                }
                Py_DECREF(seen_instance);
                PyObject *mine = PyDict_GetItemWithError(by_rank, sender.instance);
                if (mine == NULL && PyErr_Occurred()) goto done;
                int first = mine == NULL ? 1 : earlier(span, mine);
                if (first < 0 || (first && PyDict_SetItem(by_rank, sender.instance, span) < 0)) goto done;
                first = earlier(span, seen);
                if (first < 0 || (first && PyDict_SetItem(index, key, span) < 0)) goto done;
            }
        }
        long status = PyLong_AsLong(PyTuple_GET_ITEM(span, ROW_STATUS));
        if (status == -1 && PyErr_Occurred()) goto done;
        if (status == 2) {
            int first = failed == Py_None ? 1 : earlier(span, failed);
            if (first < 0) goto done;
            if (first) failed = span;
        }
        int has_mode = PyObject_IsTrue(mode);
        if (has_mode < 0) goto done;
        if (!has_mode) mode = sender.mode; /* `if not mode: mode = origin.mode`; the Origin keeps it */
        int is_p = PyObject_RichCompareBool(sender.side, prefill, Py_EQ), is_d = 0;
        if (is_p < 0) goto done;
        if (!is_p && (is_d = PyObject_RichCompareBool(sender.side, decode, Py_EQ)) < 0) goto done;
        if (is_p && p_any == Py_None) p_any = span;
        if (is_d && d_any == Py_None) d_any = span;
    }
    result = Py_BuildValue("(OOOOOOOO)", index, first_of, ranks, failed, mode, p_any, d_any, client);
done:
    span_origin_clear(&sender);
    Py_XDECREF(key);
    Py_XDECREF(index);
    Py_XDECREF(first_of);
    Py_XDECREF(ranks);
    Py_DECREF(rows);
    return result;
}

/*   timings_of(index, offsets, stage_category, unlisted) -> timings
 *
 * Each indexed stage's (start + offset, end + offset, category): attribution.timings_of_python, step for
 * step (the reference). Its process's offset from `offsets` (0 where none), the category from
 * `stage_category` by stage label (`unlisted` where none). */
static PyObject *timings_of(PyObject *self, PyObject *args) {
    PyObject *index, *offsets, *categories, *unlisted;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &PyDict_Type, &index, &PyDict_Type, &offsets, &PyDict_Type, &categories,
                          &unlisted))
        return NULL;
    PyObject *timings = PyDict_New(), *zero = PyLong_FromLong(0), *origin = NULL, *offset = NULL; /* borrowed */
    PyObject *key, *span;
    Py_ssize_t pos = 0;
    if (timings == NULL || zero == NULL) goto fail;
    while (PyDict_Next(index, &pos, &key, &span)) {
        if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) < ROW_FIELDS || !PyTuple_Check(key) ||
            PyTuple_GET_SIZE(key) != 2) {
            PyErr_SetString(PyExc_TypeError, "an index maps (side, stage) to a model.SpanRow");
            goto fail;
        }
        if (PyTuple_GET_ITEM(span, ROW_ORIGIN) != origin) { /* spans of one sender share their Origin */
            origin = PyTuple_GET_ITEM(span, ROW_ORIGIN);
            PyObject *instance = PyObject_GetAttr(origin, origin_instance);
            if (instance == NULL) goto fail;
            offset = PyDict_GetItemWithError(offsets, instance);
            Py_DECREF(instance);
            if (offset == NULL) {
                if (PyErr_Occurred()) goto fail;
                offset = zero;
            }
        }
        PyObject *category = PyDict_GetItemWithError(categories, PyTuple_GET_ITEM(key, 1));
        if (category == NULL) {
            if (PyErr_Occurred()) goto fail;
            category = unlisted;
        }
        PyObject *start = PyNumber_Add(PyTuple_GET_ITEM(span, ROW_START), offset);
        PyObject *end = start == NULL ? NULL : PyNumber_Add(PyTuple_GET_ITEM(span, ROW_END), offset);
        PyObject *timing = end == NULL ? NULL : PyTuple_Pack(3, start, end, category);
        Py_XDECREF(start);
        Py_XDECREF(end);
        if (timing == NULL) goto fail;
        int stored = PyDict_SetItem(timings, key, timing);
        Py_DECREF(timing);
        if (stored < 0) goto fail;
    }
    Py_DECREF(zero);
    return timings;
fail:
    Py_XDECREF(zero);
    Py_XDECREF(timings);
    return NULL;
}

/* ------------------------------------------------------------------ a trace's details */

enum { HOW_TEXT, HOW_SUM, HOW_LARGEST, HOW_LAST, N_HOWS };

/* model.whole_number: `value` as a whole number in [0, limit] into *out (1), or not one (0); -1 on error.
 * An int (not a bool) as it is, a float truncated, a str as int() reads it; the float's comparisons
 * are Python's own (exact between a float and an int). */
static int whole_number(PyObject *value, PyObject *limit_object, int64_t limit, int64_t *out) {
    PyObject *number = NULL;
    if (PyLong_CheckExact(value)) {
        number = Py_NewRef(value);
    } else if (PyFloat_CheckExact(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        if (!isfinite(d) || d < 0) return 0;
        int within = PyObject_RichCompareBool(value, limit_object, Py_LE);
        if (within <= 0) return within;
        number = PyNumber_Long(value);
    } else if (PyUnicode_Check(value)) {
        number = PyLong_FromUnicodeObject(value, 10);
        if (number == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
            PyErr_Clear();
            return 0;
        }
    } else {
        return 0;
    }
    if (number == NULL) return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(number, &overflow);
    Py_DECREF(number);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < 0 || v > limit) return 0;
    *out = v;
    return 1;
}

/*   details(breakdown, spans, config) -> None
 *
 * attribution.details_python, step for step (the reference; the tests hold the two to the same
 * breakdowns): the detail attributes' values set on the breakdown. config = attribution._DETAILS_CONFIG. */
static PyObject *details(PyObject *self, PyObject *args) {
    PyObject *breakdown, *spans, *config, *by_stage, *fields, *hows;
    if (!PyArg_ParseTuple(args, "OOO!", &breakdown, &spans, &PyTuple_Type, &config)) return NULL;
    if (!PyArg_ParseTuple(config, "O!O!O!", &PyDict_Type, &by_stage, &PyDict_Type, &fields, &PyTuple_Type, &hows))
        return NULL;
    if (PyTuple_GET_SIZE(hows) != N_HOWS) {
        PyErr_SetString(PyExc_ValueError, "four ways to combine a detail");
        return NULL;
    }
    PyObject *rows = PySequence_Fast(spans, "spans must be a sequence");
    if (rows == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(rows); i++) {
        PyObject *span = PySequence_Fast_GET_ITEM(rows, i);
        if (!PyTuple_Check(span) || PyTuple_GET_SIZE(span) < ROW_FIELDS) {
            PyErr_SetString(PyExc_TypeError, "a span must be a model.SpanRow");
            goto fail;
        }
        PyObject *keys = PyDict_GetItemWithError(by_stage, PyTuple_GET_ITEM(span, ROW_STAGE));
        if (keys == NULL) {
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        PyObject *attrs = PyTuple_GET_ITEM(span, ROW_ATTRS);
        if (!PyDict_Check(attrs) || !PyTuple_Check(keys)) {
            PyErr_SetString(PyExc_TypeError, "a span's attrs must be a dict, a stage's keys a tuple");
            goto fail;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(keys); k++) {
            PyObject *key = PyTuple_GET_ITEM(keys, k), *value = PyDict_GetItemWithError(attrs, key);
            if (value == NULL) {
                if (PyErr_Occurred()) goto fail;
                continue;
            }
            int set = PyObject_IsTrue(value);
            if (set < 0) goto fail;
            if (!set) continue;
            PyObject *spec = PyDict_GetItemWithError(fields, key), *field, *how_name, *limit_object;
            if (spec == NULL) {
                if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
                goto fail;
            }
            if (!PyArg_ParseTuple(spec, "UUO!", &field, &how_name, &PyLong_Type, &limit_object)) goto fail;
            int how = -1;
            for (int h = 0; h < N_HOWS && how < 0; h++) {
                int same = PyObject_RichCompareBool(how_name, PyTuple_GET_ITEM(hows, h), Py_EQ);
                if (same < 0) goto fail;
                if (same) how = h;
            }
            if (how < 0) {
                PyErr_SetObject(PyExc_ValueError, how_name);
                goto fail;
            }
            if (how == HOW_TEXT) {
                PyObject *text = PyObject_Str(value);
                int stored = text == NULL ? -1 : PyObject_SetAttr(breakdown, field, text);
                Py_XDECREF(text);
                if (stored < 0) goto fail;
                continue;
            }
            int64_t limit, number, current;
            if (as_int64(limit_object, &limit) < 0) goto fail;
            int whole = whole_number(value, limit_object, limit, &number);
            if (whole < 0) goto fail;
            if (!whole) continue;
            if (how != HOW_LAST) {
                PyObject *now = PyObject_GetAttr(breakdown, field);
                int ok = now == NULL ? -1 : as_int64(now, &current);
                Py_XDECREF(now);
                if (ok < 0) goto fail;
                if (how == HOW_SUM) { /* ranks' values add up, unless the sum would pass the limit */
                    int64_t total;
                    number = __builtin_add_overflow(current, number, &total) || total > limit ? current : total;
                } else if (current > number) {
                    number = current;
                }
            }
            PyObject *result = PyLong_FromLongLong(number);
            int stored = result == NULL ? -1 : PyObject_SetAttr(breakdown, field, result);
            Py_XDECREF(result);
            if (stored < 0) goto fail;
        }
    }
    Py_DECREF(rows);
    Py_RETURN_NONE;
fail:
    Py_DECREF(rows);
    return NULL;
}

/* ------------------------------------------------------------------ the explanation */

/* A decided trace's one sentence, word for word as kvtrace.collectors.explain.explain_python (the
 * reference and the rules; the tests hold the two to the same sentence on contract traces of every
 * shape and on random breakdowns). Built as UTF-8 in one buffer, whole numbers without printf: compiled
 * Python spent ~5 µs a trace in the attributor formatting numbers and joining clauses, this ~1.5.
 * config = explain._NATIVE_CONFIG. A number C cannot carry exactly (an int beyond int64, a quotient of
 * ints beyond 2**53) raises OverflowError, a value of another type TypeError: Python then explains it. */

#define EXACT_IN_DOUBLE (1LL << 53)

typedef struct {
    Buffer out;
    PyObject *b, *timings, *parts, *critical, *segments;
    int64_t start_ns, ttft_ns;
    /* config: see explain._NATIVE_CONFIG */
    PyObject *gap, *side_names, *templates, *phrase_keys, *transfer_ops, *prefill_side, *decode_side, *kv_first,
        *registration_first, *unattributed;
    double runner_up_share;
    Py_ssize_t max_missing_named;
} Explain;


enum { PHRASE_PREFILL, PHRASE_RENDEZVOUS, PHRASE_REGISTRATION, PHRASE_WRITE, PHRASE_READ, N_PHRASES };

static int put(Buffer *o, const char *text) { return buffer_put(o, text, (Py_ssize_t)strlen(text)); }

static int put_str(Buffer *o, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "words to explain must be str");
        return -1;
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n); /* UnicodeEncodeError on a lone surrogate */
    return utf8 == NULL ? -1 : buffer_put(o, utf8, n);
}

/* An integer in decimal, with a comma between each group of three digits where `grouped` (Python's
 * "," format option); without printf, which costs more than the rest of a sentence. */
static int put_int(Buffer *o, long long value, int grouped) {
    char digits[32], text[48];
    int n = 0, t = 0;
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        digits[n++] = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    if (value < 0) text[t++] = '-';
    for (int i = n - 1; i >= 0; i--) {
        text[t++] = digits[i];
        if (grouped && i && i % 3 == 0) text[t++] = ',';
    }
    return buffer_put(o, text, t);
}

/* printf-style into the buffer: glibc's %f rounds the exact binary value half to even, as Python's
 * float formatting does. */
static int put_format(Buffer *o, const char *format, double value) {
    char text[64];
    int n = snprintf(text, sizeof text, format, value);
    if (n < 0 || n >= (int)sizeof text) {
        PyErr_SetString(PyExc_OverflowError, "a number too long to explain");
        return -1;
    }
    return buffer_put(o, text, n);
}

/* "{:,.0f}": the integer nearest the double's exact value, halves to even, as %.0f and Python round it
 * (nearbyint in the default rounding mode); every double here is far below 2**63. */
static int put_grouped_double(Buffer *o, double value) {
    double rounded = nearbyint(value);
    if (rounded == 0 && signbit(value)) return put(o, "-0"); /* as Python writes -0.4 */
    return put_int(o, (long long)rounded, 1);
}

/* explain._ms */
static int put_ms(Buffer *o, int64_t ns) {
    double ms = (double)ns / 1e6;
    if (ms >= 10) return put_grouped_double(o, ms) < 0 ? -1 : put(o, " ms");
    return put_format(o, ms >= 0.1 ? "%.1f ms" : "%.2f ms", ms);
}

/* explain._bytes */
static int put_bytes(Buffer *o, int64_t n) {
    double mb = (double)n / 1e6;
    if (mb >= 1000) return put_format(o, "%.1f GB", mb / 1e3);
    if (mb >= 10) return put_grouped_double(o, mb) < 0 ? -1 : put(o, " MB");
    if (mb >= 0.1) return put_format(o, "%.1f MB", mb);
    return put_format(o, "%.1f kB", (double)n / 1e3);
}

static int exact_in_double(int64_t value) {
    if (value > -EXACT_IN_DOUBLE && value < EXACT_IN_DOUBLE) return 1;
    PyErr_SetString(PyExc_OverflowError, "a number beyond 2**53");
    return 0;
}

/* int / int as Python divides them: exactly what double division gives where both are exact doubles. */
static int true_divide(int64_t a, int64_t b, double *out) {
    if (!exact_in_double(a) || !exact_in_double(b)) return -1;
    *out = (double)a / (double)b;
    return 0;
}

/* explain._share: round() halves to even, as nearbyint does in the default rounding mode. */
static int put_share(Buffer *o, int64_t part_ns, int64_t ttft_ns) {
    int64_t hundred;
    double share;
    if (__builtin_mul_overflow(part_ns, (int64_t)100, &hundred)) {
        PyErr_SetString(PyExc_OverflowError, "a share beyond int64");
        return -1;
    }
    if (true_divide(hundred, ttft_ns, &share) < 0) return -1;
    return put_int(o, (long long)nearbyint(share), 0) < 0 ? -1 : put(o, " %");
}

/* explain._stage_name: "P's prefill" */
static int put_stage_name(Explain *e, PyObject *key) {
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_SetString(PyExc_TypeError, "a stage key must be (side, stage)");
        return -1;
    }
    PyObject *side = PyTuple_GET_ITEM(key, 0), *stage = PyTuple_GET_ITEM(key, 1);
    PyObject *name = PyDict_GetItemWithError(e->side_names, side);
    if (name == NULL && PyErr_Occurred()) return -1;
    if (put_str(&e->out, name != NULL ? name : side) < 0 || put(&e->out, "'s ") < 0) return -1;
    Py_ssize_t from = e->out.len;
    if (put_str(&e->out, stage) < 0) return -1;
    for (Py_ssize_t i = from; i < e->out.len; i++) /* stage.replace("_", " "): '_' is never part of a UTF-8 sequence */
        if (e->out.data[i] == '_') e->out.data[i] = ' ';
    return 0;
}

static int equal(PyObject *a, PyObject *b) { return PyObject_RichCompareBool(a, b, Py_EQ); }

/* timings[key] as (start, end, category), or 0 where the trace has no such stage. */
static int timing_of(Explain *e, PyObject *key, int64_t *start, int64_t *end, PyObject **category) {
    PyObject *timing = PyDict_GetItemWithError(e->timings, key);
    if (timing == NULL) return PyErr_Occurred() ? -1 : 0;
    return unpack_timing(timing, start, end, category) < 0 ? -1 : 1;
}

/* explain._stage_phrase */
static int put_stage_phrase(Explain *e, PyObject *key, int64_t critical) {
    Buffer *o = &e->out;
    int phrase = -1;
    for (int i = 0; i < N_PHRASES && phrase < 0; i++) {
        int same = equal(key, PyTuple_GET_ITEM(e->phrase_keys, i));
        if (same < 0) return -1;
        if (same) phrase = i;
    }
    if (phrase == PHRASE_PREFILL) {
        int64_t tokens;
        if (put(o, "P's prefill") < 0) return -1;
        PyObject *value = field(e->b, F_PROMPT_TOKENS);
        if (value == NULL) return -1;
        int ok = as_int64(value, &tokens);
        Py_DECREF(value);
        if (ok < 0) return -1;
        if (tokens && (put(o, " of ") < 0 || put_int(o, tokens, 1) < 0 || put(o, " tokens") < 0)) return -1;
        return put(o, " took ") < 0 ? -1 : put_ms(o, critical);
    }
    if (phrase == PHRASE_RENDEZVOUS || phrase == PHRASE_REGISTRATION) {
        PyObject *order = field(e->b, F_RENDEZVOUS_ORDER);
        if (order == NULL) return -1;
        int kv_first = equal(order, e->kv_first);
        int registration_first = kv_first ? 0 : equal(order, e->registration_first);
        Py_DECREF(order);
        if (kv_first < 0 || registration_first < 0) return -1;
        if (phrase == PHRASE_RENDEZVOUS) {
            if (kv_first)
                return put(o, "the rendezvous waited ") < 0 || put_ms(o, critical) < 0 ? -1
                       : put(o, " for D's registration (P's blocks were ready first)");
            if (put(o, "the rendezvous took ") < 0 || put_ms(o, critical) < 0) return -1;
            return registration_first ? put(o, " after D's registration had arrived") : 0;
        }
        if (put(o, "D's registration took ") < 0 || put_ms(o, critical) < 0 || put(o, " to reach P") < 0) return -1;
        if (!kv_first) return 0;
        int64_t start, end, waited;
        int found = timing_of(e, PyTuple_GET_ITEM(e->phrase_keys, PHRASE_RENDEZVOUS), &start, &end, NULL);
        if (found <= 0) return found;
        if (__builtin_sub_overflow(end, start, &waited)) {
            PyErr_SetString(PyExc_OverflowError, "a time beyond int64");
            return -1;
        }
        return put(o, ", whose finished blocks waited ") < 0 || put_ms(o, waited) < 0 ? -1
               : put(o, " for it at the rendezvous");
    }
    if (phrase == PHRASE_WRITE || phrase == PHRASE_READ) {
        int64_t size, start, end, took;
        PyObject *value = field(e->b, F_TRANSFER_BYTES);
        if (value == NULL) return -1;
        int ok = as_int64(value, &size);
        Py_DECREF(value);
        if (ok < 0 || put(o, "the NIXL ") < 0 ||
            put_str(o, PyTuple_GET_ITEM(e->transfer_ops, phrase == PHRASE_WRITE ? 0 : 1)) < 0)
            return -1;
        if (!size) return put(o, " took ") < 0 ? -1 : put_ms(o, critical);
        int found = timing_of(e, key, &start, &end, NULL);
        if (found <= 0) {
            if (found == 0) PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        double rate;
        if (__builtin_sub_overflow(end, start, &took)) {
            PyErr_SetString(PyExc_OverflowError, "a time beyond int64");
            return -1;
        }
        if (true_divide(size, took > 1 ? took : 1, &rate) < 0) return -1; /* bytes per ns = GB/s */
        if (put(o, " of ") < 0 || put_bytes(o, size) < 0 || put(o, " took ") < 0 || put_ms(o, critical) < 0 ||
            put(o, " (") < 0)
            return -1;
        if ((rate >= 0.1 ? put_format(o, "%.2f GB/s", rate) : put_format(o, "%.1f MB/s", rate * 1e3)) < 0) return -1;
        return put(o, ")");
    }
    PyObject *template = PyDict_GetItemWithError(e->templates, key); /* (before "{ms}", after it) */
    if (template == NULL && PyErr_Occurred()) return -1;
    if (template != NULL)
        return put_str(o, PyTuple_GET_ITEM(template, 0)) < 0 || put_ms(o, critical) < 0 ? -1
               : put_str(o, PyTuple_GET_ITEM(template, 1));
    return put_stage_name(e, key) < 0 || put(o, " took ") < 0 ? -1 : put_ms(o, critical); /* outside the contract */
}

/* explain._longest_gap */
static int put_longest_gap(Explain *e) {
    Py_ssize_t n = PyList_GET_SIZE(e->segments), gaps = 0, at = -1;
    int64_t widest = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *segment = PyList_GET_ITEM(e->segments, i);
        if (!PyTuple_Check(segment) || PyTuple_GET_SIZE(segment) != 3) {
            PyErr_SetString(PyExc_TypeError, "a segment must be (key, start, end)");
            return -1;
        }
        int is_gap = equal(PyTuple_GET_ITEM(segment, 0), e->gap);
        if (is_gap < 0) return -1;
        if (!is_gap) continue;
        int64_t start, end, width;
        if (as_int64(PyTuple_GET_ITEM(segment, 1), &start) < 0 || as_int64(PyTuple_GET_ITEM(segment, 2), &end) < 0)
            return -1;
        if (__builtin_sub_overflow(end, start, &width)) {
            PyErr_SetString(PyExc_OverflowError, "a time beyond int64");
            return -1;
        }
        gaps++;
        if (at < 0 || width >= widest) { /* the widest; of equals, the last (max() over (width, index)) */
            widest = width;
            at = i;
        }
    }
    if (!gaps) return 0;
    PyObject *before = at > 0 ? PyTuple_GET_ITEM(PyList_GET_ITEM(e->segments, at - 1), 0) : NULL;
    PyObject *after = at + 1 < n ? PyTuple_GET_ITEM(PyList_GET_ITEM(e->segments, at + 1), 0) : NULL;
    int has_before = before != NULL ? PyObject_IsTrue(before) : 0;
    int has_after = after != NULL ? PyObject_IsTrue(after) : 0;
    if (has_before < 0 || has_after < 0) return -1;
    if (!has_before && !has_after) return 0;
    Buffer *o = &e->out;
    if (gaps > 1 && (put(o, " (the longest, ") < 0 || put_ms(o, widest) < 0 || put(o, ", ") < 0)) return -1;
    if (gaps == 1 && put(o, " (") < 0) return -1;
    if (has_before && has_after) {
        if (put(o, "between ") < 0 || put_stage_name(e, before) < 0 || put(o, " and ") < 0 ||
            put_stage_name(e, after) < 0)
            return -1;
    } else if (has_before) {
        if (put(o, "after ") < 0 || put_stage_name(e, before) < 0) return -1;
    } else if (put(o, "before ") < 0 || put_stage_name(e, after) < 0) {
        return -1;
    }
    return put(o, ")");
}

/* explain._part_clause */
static int put_part_clause(Explain *e, PyObject *part, int64_t part_ns) {
    Buffer *o = &e->out;
    if (put_share(o, part_ns, e->ttft_ns) < 0) return -1;
    int unattributed = equal(part, e->unattributed);
    if (unattributed < 0) return -1;
    if (unattributed)
        return put(o, " unattributed: no span covers ") < 0 || put_ms(o, part_ns) < 0 ||
               put(o, " of the critical path") < 0 ? -1 : put_longest_gap(e);
    if (put(o, " ") < 0 || put_str(o, part) < 0) return -1;
    PyObject *key, *value, *best_key = NULL;
    int64_t best = 0;
    Py_ssize_t pos = 0;
    while (PyDict_Next(e->critical, &pos, &key, &value)) { /* max((critical, key)) over the part's stages on the path */
        int64_t critical, start, end;
        PyObject *category;
        if (as_int64(value, &critical) < 0) return -1;
        if (critical <= 0) continue;
        int found = timing_of(e, key, &start, &end, &category);
        if (found < 0) return -1;
        if (!found) continue;
        int same = equal(category, part);
        if (same < 0) return -1;
        if (!same) continue;
        int later = 0;
        if (best_key != NULL && critical == best && (later = PyObject_RichCompareBool(key, best_key, Py_GT)) < 0)
            return -1;
        if (best_key == NULL || critical > best || later) {
            best_key = key;
            best = critical;
        }
    }
    if (best_key == NULL) return 0;
    return put(o, ": ") < 0 ? -1 : put_stage_phrase(e, best_key, best);
}

/* explain._failed */
static int put_failed(Explain *e) {
    Buffer *o = &e->out;
    PyObject *stage = field(e->b, F_ERROR_STAGE), *cause = NULL;
    int result = -1, has_stage, has_cause;
    if (stage == NULL || (has_stage = PyObject_IsTrue(stage)) < 0) goto done;
    if (put(o, "Failed: ") < 0) goto done;
    if (has_stage ? put_stage_name(e, stage) < 0 || put(o, " ended in error") < 0 : put(o, "a span ended in error") < 0)
        goto done;
    if ((cause = field(e->b, F_ERROR_TYPE)) == NULL || (has_cause = PyObject_IsTrue(cause)) < 0)
        goto done;
    if (has_cause && (put(o, " (") < 0 || put_str(o, cause) < 0 || put(o, ")") < 0)) goto done;
    if (has_stage) {
        int64_t start, end, into;
        int found = timing_of(e, stage, &start, &end, NULL);
        if (found < 0) goto done;
        if (found) {
            if (__builtin_sub_overflow(end, e->start_ns, &into)) {
                PyErr_SetString(PyExc_OverflowError, "a time beyond int64");
                goto done;
            }
            if (put(o, " ") < 0 || put_ms(o, into > 0 ? into : 0) < 0 || put(o, " in") < 0) goto done;
        }
    }
    result = put(o, ".");
done:
    Py_XDECREF(stage);
    Py_XDECREF(cause);
    return result;
}

/* explain._missing */
static int put_missing(Explain *e) {
    Buffer *o = &e->out;
    PyObject *sides[2] = {e->prefill_side, e->decode_side}, *absent[2] = {NULL, NULL};
    int instances[2] = {F_PREFILL_INSTANCE, F_DECODE_INSTANCE};
    Py_ssize_t n_absent = 0, said = 0;
    for (int i = 0; i < 2; i++) {
        PyObject *instance = field(e->b, instances[i]);
        if (instance == NULL) return -1;
        int has = PyObject_IsTrue(instance);
        Py_DECREF(instance);
        if (has < 0) return -1;
        if (!has) absent[n_absent++] = sides[i];
    }
    for (Py_ssize_t i = 0; i < n_absent; i++) {
        PyObject *name = PyDict_GetItemWithError(e->side_names, absent[i]);
        if (name == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, absent[i]);
            return -1;
        }
        if ((said++ && put(o, " and ") < 0) || put(o, "no span from ") < 0 || put_str(o, name) < 0 ||
            put(o, " arrived") < 0)
            return -1;
    }
    PyObject *missing = field(e->b, F_MISSING), *list = NULL;
    if (missing == NULL) return -1;
    list = PySequence_Fast(missing, "missing must be a sequence");
    Py_DECREF(missing);
    if (list == NULL) return -1;
    Py_ssize_t named = 0;
    int more = 0, result = -1;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(list); i++) {
        PyObject *stage = PySequence_Fast_GET_ITEM(list, i);
        if (!PyUnicode_Check(stage)) {
            PyErr_SetString(PyExc_TypeError, "a missing stage must be str");
            goto done;
        }
        Py_ssize_t colon = PyUnicode_FindChar(stage, ':', 0, PyUnicode_GET_LENGTH(stage), 1);
        if (colon == -2) goto done;
        PyObject *side = PyUnicode_Substring(stage, 0, colon >= 0 ? colon : PyUnicode_GET_LENGTH(stage));
        if (side == NULL) goto done;
        int of_absent = 0;
        for (Py_ssize_t a = 0; a < n_absent && !of_absent; a++)
            if ((of_absent = equal(side, absent[a])) < 0) break;
        Py_DECREF(side);
        if (of_absent < 0) goto done;
        if (of_absent) continue;
        if (named == e->max_missing_named) {
            more = 1;
            break;
        }
        if (put(o, named ? ", " : said ? " and " : "") < 0 || put_str(o, stage) < 0) goto done;
        named++;
    }
    if (more && put(o, " \xe2\x80\xa6") < 0) goto done; /* " …" */
    if (named && put(o, " never arrived") < 0) goto done;
    result = 0;
done:
    Py_DECREF(list);
    return result;
}

static int int_field(PyObject *b, int which, int64_t *out) {
    PyObject *value = field(b, which);
    if (value == NULL) return -1;
    int ok = as_int64(value, out);
    Py_DECREF(value);
    return ok;
}

static int truth_field(PyObject *b, int which) {
    PyObject *value = field(b, which);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *dict_field(PyObject *b, int which) {
    PyObject *value = field(b, which);
    if (value != NULL && !PyDict_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", FIELD_NAMES[which]);
        Py_CLEAR(value);
    }
    return value;
}

static PyObject *explain(PyObject *self, PyObject *args) {
    Explain e = {{0}};
    PyObject *config, *result = NULL;
    if (!PyArg_ParseTuple(args, "OO!", &e.b, &PyTuple_Type, &config)) return NULL;
    if (!PyArg_ParseTuple(config, "OO!O!O!O!OOOOOdn", &e.gap, &PyDict_Type, &e.side_names, &PyDict_Type,
                          &e.templates, &PyTuple_Type, &e.phrase_keys, &PyTuple_Type, &e.transfer_ops, &e.prefill_side,
                          &e.decode_side, &e.kv_first, &e.registration_first, &e.unattributed, &e.runner_up_share,
                          &e.max_missing_named))
        return NULL;
    if (PyTuple_GET_SIZE(e.phrase_keys) != N_PHRASES || PyTuple_GET_SIZE(e.transfer_ops) != 2) {
        PyErr_SetString(PyExc_ValueError, "five phrase keys and two transfer operations");
        return NULL;
    }
    int error = truth_field(e.b, F_ERROR);
    if (error < 0) return NULL;
    if ((e.timings = dict_field(e.b, F_TIMINGS)) == NULL) goto done;
    if (int_field(e.b, F_START_NS, &e.start_ns) < 0) goto done;
    if (error) {
        if (put_failed(&e) < 0) goto done;
        result = PyUnicode_DecodeUTF8(e.out.data, e.out.len, "strict");
        goto done;
    }
    if ((e.parts = dict_field(e.b, F_PARTS)) == NULL || (e.critical = dict_field(e.b, F_CRITICAL_NS)) == NULL ||
        int_field(e.b, F_TTFT_NS, &e.ttft_ns) < 0)
        goto done;
    e.segments = field(e.b, F_SEGMENTS);
    if (e.segments == NULL) goto done;
    if (!PyList_Check(e.segments)) {
        PyErr_SetString(PyExc_TypeError, "segments must be a list");
        goto done;
    }
    /* the two largest parts over zero, as sorted(((ns, part) ...), reverse=True) ranks them */
    PyObject *key, *value, *first = NULL, *second = NULL;
    int64_t first_ns = 0, second_ns = 0;
    Py_ssize_t pos = 0;
    while (PyDict_Next(e.parts, &pos, &key, &value)) {
        int64_t ns;
        if (as_int64(value, &ns) < 0) goto done;
        if (ns <= 0) continue;
        int above_first = first == NULL || ns > first_ns, above_second = second == NULL || ns > second_ns;
        if (!above_first && ns == first_ns && (above_first = PyObject_RichCompareBool(key, first, Py_GT)) < 0)
            goto done;
        if (!above_first && !above_second && ns == second_ns &&
            (above_second = PyObject_RichCompareBool(key, second, Py_GT)) < 0)
            goto done;
        if (above_first) {
            second = first, second_ns = first_ns;
            first = key, first_ns = ns;
        } else if (above_second) {
            second = key, second_ns = ns;
        }
    }
    int complete = truth_field(e.b, F_COMPLETE);
    if (complete < 0) goto done;
    if (!complete) {
        if (put(&e.out, "Incomplete: ") < 0 || put_missing(&e) < 0) goto done;
        if (first != NULL && e.ttft_ns > 0 &&
            (put(&e.out, "; of ") < 0 || put_ms(&e.out, e.ttft_ns) < 0 || put(&e.out, " seen, ") < 0 ||
             put_part_clause(&e, first, first_ns) < 0))
            goto done;
    } else if (first == NULL || e.ttft_ns <= 0) {
        if (put(&e.out, "No time to explain: the trace has no TTFT") < 0) goto done;
    } else {
        if (put_part_clause(&e, first, first_ns) < 0) goto done;
        if (second != NULL) {
            if (!exact_in_double(second_ns)) goto done; /* compared as Python compares an int with a float */
            if ((double)second_ns >= e.runner_up_share * (double)e.ttft_ns &&
                (put(&e.out, "; ") < 0 || put_part_clause(&e, second, second_ns) < 0))
                goto done;
        }
    }
    if (put(&e.out, ".") < 0) goto done;
    result = PyUnicode_DecodeUTF8(e.out.data, e.out.len, "strict");
done:
    PyMem_Free(e.out.data);
    Py_XDECREF(e.timings);
    Py_XDECREF(e.parts);
    Py_XDECREF(e.critical);
    Py_XDECREF(e.segments);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, "Decode an OTLP ExportTraceServiceRequest: (rows, origins, columns)."},
    {"attributes", attributes, METH_VARARGS, "Span.attributes entries for the keys whose value is not None."},
    {"stage_columns", stage_columns, METH_VARARGS, "The requests' per-stage list columns, packed."},
    {"number_columns", number_columns, METH_VARARGS, "The requests' numeric columns, packed."},
    {"walk", walk, METH_VARARGS, "(parts, critical, segments): the critical path from end back to start."},
    {"index_spans", index_spans, METH_VARARGS, "A trace's spans indexed by stage, process and rank."},
    {"timings_of", timings_of, METH_VARARGS, "Each indexed stage's start and end with its offset, and category."},
    {"details", details, METH_VARARGS, "The detail attributes' values set on the breakdown."},
    {"explain", explain, METH_VARARGS, "A decided trace's breakdown in one sentence."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp", "OTLP trace requests decoded natively.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__otlp(void) { return intern_names() < 0 ? NULL : PyModule_Create(&module); }
