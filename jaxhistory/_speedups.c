/* Compiled forms of the host path's busiest steps: a repeated dict of finite
 * floats parsed into a row, staged into its table, copied for the log and put
 * into the summary line. Each function does exactly what the Python function
 * it stands in for does (named beside it); where a case falls outside what it
 * handles, it says so (None, 0) and the caller takes the Python path. Where
 * this module is missing (no compiler at install time), the Python functions
 * run instead, with the same results (tests/test_speedups.py holds both to
 * each other).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The int64 range of steps: a step past it is refused by the Python path. */
static int
step_in_range(PyObject *step, long long lowest, long long *out)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(step, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow || v < lowest) {
        return 0;
    }
    *out = v;
    return 1;
}

/* A Row from its six fields: tuple.__new__(row_type, fields). */
static PyObject *
new_row(PyObject *row_type, PyObject *fields)
{
    PyObject *args = PyTuple_Pack(1, fields);
    if (args == NULL) {
        return NULL;
    }
    PyObject *made = PyTuple_Type.tp_new((PyTypeObject *)row_type, args, NULL);
    Py_DECREF(args);
    return made;
}

static PyObject *step_label; /* "step" */
static PyObject *str_lock, *str_length, *str_rows, *str_row_steps;
static PyObject *str_last_step, *str_acquire, *str_release, *str_step;
static PyObject *int_zero, *int_one;

/* Takes ``owner``'s lock (attribute ``name``) and acquires it: the lock (a
 * new reference, for release()), or NULL with an error set. */
static PyObject *
acquire(PyObject *owner, PyObject *name)
{
    PyObject *lock = PyObject_GetAttr(owner, name);
    if (lock == NULL) {
        return NULL;
    }
    PyObject *got = PyObject_CallMethodNoArgs(lock, str_acquire);
    if (got == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_DECREF(got);
    return lock;
}

/* Releases ``lock`` (and the reference acquire() gave) whatever happened:
 * an error set before stays set. -1 where the release itself failed. */
static int
release(PyObject *lock)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *released = PyObject_CallMethodNoArgs(lock, str_release);
    Py_DECREF(lock);
    if (released == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    Py_DECREF(released);
    PyErr_Restore(type, value, tb);
    return 0;
}

/* _row.repeated: repeated(repeat, metrics, next_step, timestamp, step,
 * row_type, finite_kind) -> Row | None.
 *
 * ``repeat`` is a _row.Repeat (keys, names, step_at). Returns the Row
 * (step, names, values, finite_kind, timestamp, "step") where ``metrics`` is a
 * dict with exactly ``repeat.keys`` in order, every value but the step entry a
 * finite float (exactly float), and a step that is an int in
 * [next_step, INT64_MAX]; None for anything else. */
static PyObject *
repeated(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "repeated() takes 7 arguments");
        return NULL;
    }
    PyObject *repeat = args[0], *metrics = args[1], *next_step = args[2];
    PyObject *timestamp = args[3], *step = args[4], *row_type = args[5];
    PyObject *finite_kind = args[6];
    if (!PyDict_CheckExact(metrics) || !PyTuple_Check(repeat) ||
        PyTuple_GET_SIZE(repeat) != 3 || !PyType_Check(row_type) ||
        !PyType_IsSubtype((PyTypeObject *)row_type, &PyTuple_Type)) {
        Py_RETURN_NONE;
    }
    PyObject *keys = PyTuple_GET_ITEM(repeat, 0);
    PyObject *names = PyTuple_GET_ITEM(repeat, 1);
    PyObject *step_at = PyTuple_GET_ITEM(repeat, 2);
    if (!PyTuple_Check(keys) || !PyLong_CheckExact(next_step)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(keys);
    if (PyDict_GET_SIZE(metrics) != k) {
        Py_RETURN_NONE;
    }
    Py_ssize_t at = -2; /* -2: no step entry */
    if (step_at != Py_None) {
        if (!PyLong_CheckExact(step_at)) {
            Py_RETURN_NONE;
        }
        at = PyLong_AsSsize_t(step_at);
        if (at == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (at < 0) {
            at += k;
        }
        if (at < 0 || at >= k) {
            Py_RETURN_NONE;
        }
    }
    long long lowest, chosen;
    if (!step_in_range(next_step, LLONG_MIN, &lowest)) {
        Py_RETURN_NONE; /* next_step past int64: refused there */
    }
    PyObject *values = PyTuple_New(at == -2 ? k : k - 1);
    if (values == NULL) {
        return NULL;
    }
    PyObject *entry = NULL; /* the step entry's value (borrowed) */
    Py_ssize_t pos = 0, i = 0, j = 0;
    PyObject *key, *value;
    /* The Python form takes the row as finite where sum(values, 0.0) is: a
     * sum that (from Python 3.12, compensated) may overflow where each value
     * is finite. Every value here is finite and at most 2**1000 in
     * magnitude, so no sum of them overflows and both forms agree; a larger
     * or non-finite value is left to the Python form. */
    while (i < k && PyDict_Next(metrics, &pos, &key, &value)) {
        PyObject *want = PyTuple_GET_ITEM(keys, i);
        /* exact str only: comparing them runs no Python code, which could
         * change the dict under this loop (other keys: the Python path) */
        if (key != want && (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(want) ||
                            PyUnicode_Compare(key, want) != 0)) {
            goto none;
        }
        if (i == at) {
            entry = value;
        }
        else {
            if (!PyFloat_CheckExact(value)) {
                goto none;
            }
            if (!(fabs(PyFloat_AS_DOUBLE(value)) <= 0x1p1000)) {
                goto none; /* (NaN fails the comparison too) */
            }
            Py_INCREF(value);
            PyTuple_SET_ITEM(values, j, value);
            j++;
        }
        i++;
    }
    if (i != k || j == 0 || k > (1 << 20)) {
        goto none;
    }
    PyObject *chosen_step;
    if (step != Py_None) {
        if (at != -2 || !PyLong_CheckExact(step) ||
            !step_in_range(step, lowest, &chosen)) {
            goto none;
        }
        chosen_step = step;
    }
    else if (at == -2) {
        chosen_step = next_step;
    }
    else {
        if (!PyLong_CheckExact(entry) || !step_in_range(entry, lowest, &chosen)) {
            goto none;
        }
        chosen_step = entry;
    }
    PyObject *fields = PyTuple_Pack(6, chosen_step, names, values, finite_kind,
                                    timestamp, step_label);
    Py_DECREF(values);
    if (fields == NULL) {
        return NULL;
    }
    PyObject *made = new_row(row_type, fields);
    Py_DECREF(fields);
    return made;
none:
    Py_DECREF(values); /* (slots not yet set are NULL: tuple dealloc skips them) */
    Py_RETURN_NONE;
}


/* _row.queued's compiled form: queued(metrics, k, step, timestamp) ->
 * (a copy of ``metrics`` without its "step" entry where it holds more than
 * ``k`` entries, step, timestamp). Where the copy is untracked by the garbage
 * collector (a dict of numbers), so is the tuple: thousands of them may wait
 * in the log's queue, and tracked ones would set off full collections. (The
 * Python form puts step and time into the copy instead, under 0 and 1:
 * adding them costs the copy a resize here.) */
static PyObject *
queued(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "queued() takes 4 arguments");
        return NULL;
    }
    if (!PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "queued() needs a dict");
        return NULL;
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[1]);
    if (k == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *copy = PyDict_Copy(args[0]);
    if (copy == NULL) {
        return NULL;
    }
    if (PyDict_GET_SIZE(copy) != k && PyDict_DelItem(copy, str_step) < 0) {
        Py_DECREF(copy);
        return NULL;
    }
    PyObject *item = PyTuple_Pack(3, copy, args[2], args[3]);
    int tracked = PyObject_GC_IsTracked(copy);
    Py_DECREF(copy);
    if (item != NULL && !tracked && PyLong_CheckExact(args[2]) &&
        (PyFloat_CheckExact(args[3]) || args[3] == Py_None)) {
        PyObject_GC_UnTrack(item);
    }
    return item;
}

/* The decimal digits of ``n`` at ``text``; returns how many. */
static int
put_digits(char *text, unsigned long long n)
{
    char reversed[24];
    int count = 0;
    do {
        reversed[count++] = (char)('0' + n % 10);
        n /= 10;
    } while (n);
    for (int i = 0; i < count; i++) {
        text[i] = reversed[count - 1 - i];
    }
    return count;
}

/* A growing byte buffer for one line. */
typedef struct {
    char *data;
    Py_ssize_t size, cap;
    char small[512];
} Buffer;

static int
buffer_put(Buffer *b, const char *text, Py_ssize_t n)
{
    if (b->size + n > b->cap) {
        Py_ssize_t cap = (b->size + n) * 2;
        char *data = PyMem_Malloc(cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(data, b->data, b->size);
        if (b->data != b->small) {
            PyMem_Free(b->data);
        }
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->size, text, n);
    b->size += n;
    return 0;
}

static const double powers_of_ten[] = {
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12,
};
#define FAST_DIGITS 12
#define FAST_BELOW 1099511627776.0 /* 2**40 */

/* ``value`` with ``precision`` decimals, as "%.{precision}f" % value gives it,
 * into ``b``. Sets ``*zero`` where the text shows no nonzero digit. */
static int
put_fixed(Buffer *b, double value, int precision, int *zero)
{
    double scaled = fabs(value) * powers_of_ten[precision <= FAST_DIGITS ? precision : 0];
    if (precision <= FAST_DIGITS && scaled < FAST_BELOW) {
        /* |scaled - exact| <= 2**40 * 2**-53 = 2**-13: rounding to the nearest
         * integer is exact unless the fraction lies near one half (there the
         * correctly rounded text comes from the general routine below) */
        double whole = floor(scaled), fraction = scaled - whole;
        if (fabs(fraction - 0.5) >= 1.0 / 2048) {
            uint64_t q = (uint64_t)whole + (fraction > 0.5);
            uint64_t scale = (uint64_t)powers_of_ten[precision];
            uint64_t integral = q / scale, decimals = q % scale;
            char text[64];
            int at = 0;
            if (signbit(value)) {
                text[at++] = '-';
            }
            at += put_digits(text + at, (unsigned long long)integral);
            if (precision > 0) {
                text[at++] = '.';
                for (int d = precision - 1; d >= 0; d--) {
                    text[at + d] = (char)('0' + decimals % 10);
                    decimals /= 10;
                }
                at += precision;
            }
            *zero = q == 0;
            return buffer_put(b, text, at);
        }
    }
    char *text = PyOS_double_to_string(value, 'f', precision, 0, NULL);
    if (text == NULL) {
        return -1;
    }
    *zero = 1;
    for (char *c = text; *c; c++) {
        if (*c >= '1' && *c <= '9') {
            *zero = 0;
            break;
        }
    }
    int failed = buffer_put(b, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return failed;
}

/* _summary.SummaryLine.format_floats' template: fixed_line(pieces, step,
 * values, precision) -> str | None: pieces[0] (UTF-8 bytes), the step,
 * then for each value pieces[i + 1] and the value with ``precision``
 * decimals. None where a nonzero value would show as zero (the caller writes
 * that line in e-notation). */
static PyObject *
fixed_line(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fixed_line() takes 4 arguments");
        return NULL;
    }
    PyObject *pieces = args[0], *step = args[1], *values = args[2];
    int overflow = 0;
    long precision = PyLong_AsLongAndOverflow(args[3], &overflow);
    if (precision == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyTuple_Check(pieces) || !PyTuple_Check(values) ||
        PyTuple_GET_SIZE(pieces) != PyTuple_GET_SIZE(values) + 1 || precision < 0 ||
        overflow < 0) {
        PyErr_SetString(PyExc_ValueError, "fixed_line(): pieces do not fit");
        return NULL;
    }
    if (overflow || precision > 1000) {
        Py_RETURN_NONE; /* that many decimals: the caller's general path */
    }
    long long step_value = PyLong_AsLongLongAndOverflow(step, &overflow);
    if ((step_value == -1 && PyErr_Occurred()) || overflow) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Buffer b;
    b.data = b.small;
    b.size = 0;
    b.cap = sizeof(b.small);
    PyObject *result = NULL;
    char number[32];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pieces); i++) {
        PyObject *piece = PyTuple_GET_ITEM(pieces, i);
        if (!PyBytes_Check(piece)) {
            PyErr_SetString(PyExc_TypeError, "fixed_line(): pieces are bytes");
            goto done;
        }
        if (buffer_put(&b, PyBytes_AS_STRING(piece), PyBytes_GET_SIZE(piece)) < 0) {
            goto done;
        }
        if (i == 0) {
            int n = 0;
            if (step_value < 0) {
                number[n++] = '-';
            }
            n += put_digits(number + n, step_value < 0
                                            ? 0ULL - (unsigned long long)step_value
                                            : (unsigned long long)step_value);
            if (buffer_put(&b, number, n) < 0) {
                goto done;
            }
            continue;
        }
        PyObject *value = PyTuple_GET_ITEM(values, i - 1);
        if (!PyFloat_CheckExact(value)) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
        double v = PyFloat_AS_DOUBLE(value);
        int zero;
        if (put_fixed(&b, v, (int)precision, &zero) < 0) {
            goto done;
        }
        if (zero && v != 0.0) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    result = PyUnicode_DecodeUTF8(b.data, b.size, "strict");
done:
    if (b.data != b.small) {
        PyMem_Free(b.data);
    }
    return result;
}

static PyObject *str_repeat, *str_table, *str_names, *str_n, *str_next_step;
static PyObject *str_move_stage;

static PyObject *str_device_rows, *str_scalar_dtype, *str_values, *str_steps;
static PyObject *str_fill, *str__reserve, *str_kind, *str_itemsize;

/* Whether ``dtype`` (a NumPy dtype) is float64: kind 'f', 8 bytes. */
static int
is_float64(PyObject *dtype)
{
    PyObject *kind = PyObject_GetAttr(dtype, str_kind);
    PyObject *size = kind ? PyObject_GetAttr(dtype, str_itemsize) : NULL;
    int yes = size != NULL && PyUnicode_Check(kind) &&
              PyUnicode_CompareWithASCIIString(kind, "f") == 0 &&
              PyLong_Check(size) && PyLong_AsLong(size) == 8;
    Py_XDECREF(kind);
    Py_XDECREF(size);
    return PyErr_Occurred() ? -1 : yes;
}

/* _table.Table.move_stage for a table of float64 scalars staged as tuples of
 * Python floats (no device rows), under the table's lock: 1 moved, 0 a case
 * it leaves to move_stage (nothing changed), -1 an error. */
static int
move_floats(PyObject *table)
{
    int result = -1;
    PyObject *device = NULL, *dtype = NULL, *rows = NULL, *steps_list = NULL;
    PyObject *values = NULL, *steps = NULL, *fill_obj = NULL, *end = NULL;
    PyObject *done = NULL;
    Py_buffer *views = NULL; /* one per metric, then the steps */
    int taken = 0;
    device = PyObject_GetAttr(table, str_device_rows);
    dtype = device ? PyObject_GetAttr(table, str_scalar_dtype) : NULL;
    rows = dtype ? PyObject_GetAttr(table, str_rows) : NULL;
    steps_list = rows ? PyObject_GetAttr(table, str_row_steps) : NULL;
    if (steps_list == NULL) {
        goto out;
    }
    result = 0;
    if (!PyList_CheckExact(device) || PyList_GET_SIZE(device) != 0 ||
        dtype == Py_None || !PyList_CheckExact(rows) ||
        !PyList_CheckExact(steps_list) ||
        PyList_GET_SIZE(rows) != PyList_GET_SIZE(steps_list)) {
        goto out;
    }
    int f64 = is_float64(dtype);
    if (f64 <= 0) {
        result = f64;
        goto out;
    }
    Py_ssize_t k = PyList_GET_SIZE(rows);
    if (k == 0) {
        goto out;
    }
    Py_ssize_t width = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || !PyLong_CheckExact(PyList_GET_ITEM(steps_list, i))) {
            goto out;
        }
        if (width < 0) {
            width = PyTuple_GET_SIZE(row);
        }
        if (PyTuple_GET_SIZE(row) != width) {
            goto out;
        }
        for (Py_ssize_t j = 0; j < width; j++) {
            if (!PyFloat_CheckExact(PyTuple_GET_ITEM(row, j))) {
                goto out;
            }
        }
    }
    views = PyMem_Calloc(width + 1, sizeof(Py_buffer));
    if (views == NULL) {
        PyErr_NoMemory();
        result = -1;
        goto out;
    }
    fill_obj = PyObject_GetAttr(table, str_fill);
    if (fill_obj == NULL) {
        result = -1;
        goto out;
    }
    Py_ssize_t fill = PyLong_AsSsize_t(fill_obj);
    if (fill == -1 && PyErr_Occurred()) {
        result = -1;
        goto out;
    }
    end = PyLong_FromSsize_t(fill + k);
    done = end ? PyObject_CallMethodOneArg(table, str__reserve, end) : NULL;
    values = done ? PyObject_GetAttr(table, str_values) : NULL;
    steps = values ? PyObject_GetAttr(table, str_steps) : NULL;
    if (steps == NULL) {
        result = -1;
        goto out;
    }
    if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != width) {
        goto out;
    }
    for (Py_ssize_t j = 0; j <= width; j++) {
        PyObject *array = j < width ? PyList_GET_ITEM(values, j) : steps;
        if (PyObject_GetBuffer(array, &views[j], PyBUF_RECORDS) < 0) {
            PyErr_Clear();
            goto out;
        }
        taken++;
        const char *format = views[j].format ? views[j].format : "B";
        int want_int = j == width;
        int ok = views[j].ndim == 1 && views[j].itemsize == 8 &&
                 views[j].shape[0] >= fill + k &&
                 (want_int ? (strcmp(format, "l") == 0 || strcmp(format, "q") == 0 ||
                              strcmp(format, "<l") == 0 || strcmp(format, "<q") == 0)
                           : (strcmp(format, "d") == 0 || strcmp(format, "<d") == 0));
        if (!ok) {
            goto out;
        }
    }
    /* steps first: a step past int64 leaves everything as it was */
    for (Py_ssize_t i = 0; i < k; i++) {
        int overflow = 0;
        long long step = PyLong_AsLongLongAndOverflow(PyList_GET_ITEM(steps_list, i),
                                                      &overflow);
        if (overflow || (step == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            goto out;
        }
        Py_buffer *v = &views[width];
        *(long long *)((char *)v->buf + (fill + i) * v->strides[0]) = step;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        Py_buffer *v = &views[j];
        char *at = (char *)v->buf + fill * v->strides[0];
        for (Py_ssize_t i = 0; i < k; i++) {
            PyObject *row = PyList_GET_ITEM(rows, i);
            *(double *)(at + i * v->strides[0]) =
                PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(row, j));
        }
    }
    result = -1;
    PyObject *empty[3] = {PyList_New(0), PyList_New(0), PyList_New(0)};
    PyObject *fill_after = PyLong_FromSsize_t(fill + k);
    if (empty[0] && empty[1] && empty[2] && fill_after &&
        PyObject_SetAttr(table, str_fill, fill_after) == 0 &&
        PyObject_SetAttr(table, str_rows, empty[0]) == 0 &&
        PyObject_SetAttr(table, str_row_steps, empty[1]) == 0 &&
        PyObject_SetAttr(table, str_device_rows, empty[2]) == 0) {
        result = 1;
    }
    Py_XDECREF(empty[0]);
    Py_XDECREF(empty[1]);
    Py_XDECREF(empty[2]);
    Py_XDECREF(fill_after);
out:
    for (int j = 0; j < taken; j++) {
        PyBuffer_Release(&views[j]);
    }
    PyMem_Free(views);
    Py_XDECREF(device);
    Py_XDECREF(dtype);
    Py_XDECREF(rows);
    Py_XDECREF(steps_list);
    Py_XDECREF(values);
    Py_XDECREF(steps);
    Py_XDECREF(fill_obj);
    Py_XDECREF(end);
    Py_XDECREF(done);
    return result;
}

/* move_floats(table) -> bool, for the tests (under table.lock). */
static PyObject *
move_floats_py(PyObject *self, PyObject *table)
{
    int moved = move_floats(table);
    if (moved < 0) {
        return NULL;
    }
    return PyBool_FromLong(moved);
}

/* Stages ``row`` (its step ``step``) as the (n+1)-th row of ``table``, under
 * table.lock: 1 staged, 0 another state appended first (nothing done), -1 an
 * error. Moves the stage into the arrays (table.move_stage()) once ``limit``
 * rows wait, where ``move`` (else *full is set). */
static int
stage_row(PyObject *table, PyObject *n, PyObject *step, PyObject *row,
          Py_ssize_t limit, int move, int *full)
{
    PyObject *lock = acquire(table, str_lock);
    if (lock == NULL) {
        return -1;
    }
    int result = -1;
    PyObject *length = NULL, *rows = NULL, *steps = NULL, *next = NULL;
    length = PyObject_GetAttr(table, str_length);
    if (length == NULL) {
        goto done;
    }
    int same = PyObject_RichCompareBool(length, n, Py_EQ);
    if (same <= 0) {
        result = same;
        goto done;
    }
    rows = PyObject_GetAttr(table, str_rows);
    steps = rows ? PyObject_GetAttr(table, str_row_steps) : NULL;
    if (steps == NULL) {
        goto done;
    }
    if (!PyList_CheckExact(rows) || !PyList_CheckExact(steps)) {
        PyErr_SetString(PyExc_TypeError, "a table's stage must be lists");
        goto done;
    }
    next = PyNumber_Add(n, int_one);
    if (next == NULL || PyList_Append(rows, row) < 0) {
        goto done;
    }
    if (PyList_Append(steps, step) < 0) {
        /* keep the two lists the same length */
        PyList_SetSlice(rows, PyList_GET_SIZE(rows) - 1, PyList_GET_SIZE(rows),
                        NULL);
        goto done;
    }
    if (PyObject_SetAttr(table, str_last_step, step) < 0 ||
        PyObject_SetAttr(table, str_length, next) < 0) {
        goto done;
    }
    result = 1;
    if (PyList_GET_SIZE(rows) >= limit) {
        if (!move) {
            *full = 1;
        }
        else {
            int fast = move_floats(table);
            PyObject *moved = fast ? Py_NewRef(Py_None)
                                   : PyObject_CallMethodNoArgs(table, str_move_stage);
            if (fast < 0 || moved == NULL) {
                Py_XDECREF(moved);
                result = -1; /* staged, as the Python form leaves it */
                goto done;
            }
            Py_DECREF(moved);
        }
    }
done:
    Py_XDECREF(length);
    Py_XDECREF(rows);
    Py_XDECREF(steps);
    Py_XDECREF(next);
    if (release(lock) < 0) {
        return -1;
    }
    return result;
}

/* _history_state.Appender.take: take(appender, metrics, timestamp, step,
 * row_type, finite_kind, limit) -> Row, None (nothing done: parse and append
 * it) or NotImplemented (nothing done: Appender.take decides). Parses
 * ``metrics`` as repeated() does and stages it onto the end of the
 * appender's table as Appender.append_floats does; where the appender holds
 * no table (its state was just read or set) or another state appended to the
 * table first, NotImplemented. */
static PyObject *
take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "take() takes 7 arguments");
        return NULL;
    }
    PyObject *appender = args[0];
    Py_ssize_t limit = PyLong_AsSsize_t(args[6]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *repeat = NULL, *table = NULL, *names = NULL, *next_step = NULL;
    PyObject *n = NULL, *row = NULL, *result = NULL, *after = NULL;
    repeat = PyObject_GetAttr(appender, str_repeat);
    if (repeat == NULL) {
        return NULL;
    }
    if (repeat == Py_None) {
        return repeat; /* (a new reference to None) */
    }
    table = PyObject_GetAttr(appender, str_table);
    if (table == NULL) {
        goto done;
    }
    if (table == Py_None || !PyTuple_Check(repeat) || PyTuple_GET_SIZE(repeat) != 3) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    names = PyObject_GetAttr(appender, str_names);
    if (names == NULL) {
        goto done;
    }
    if (names != PyTuple_GET_ITEM(repeat, 1)) {
        int same = PyObject_RichCompareBool(names, PyTuple_GET_ITEM(repeat, 1), Py_EQ);
        if (same < 0) {
            goto done;
        }
        if (!same) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    next_step = PyObject_GetAttr(appender, str_next_step);
    if (next_step == NULL) {
        goto done;
    }
    PyObject *parse_args[7] = {repeat, args[1], next_step, args[2],
                               args[3], args[4], args[5]};
    row = repeated(NULL, parse_args, 7);
    if (row == NULL || row == Py_None) {
        result = row;
        row = NULL;
        goto done;
    }
    n = PyObject_GetAttr(appender, str_n);
    if (n == NULL) {
        goto done;
    }
    PyObject *step = PyTuple_GET_ITEM(row, 0);
    int full = 0;
    int staged = stage_row(table, n, step, PyTuple_GET_ITEM(row, 2), limit, 1, &full);
    if (staged < 0) {
        goto done;
    }
    if (staged == 0) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *n_after = PyNumber_Add(n, int_one);
    if (n_after == NULL) {
        goto done;
    }
    int failed = PyObject_SetAttr(appender, str_n, n_after);
    Py_DECREF(n_after);
    after = PyNumber_Add(step, int_one);
    if (failed || after == NULL || PyObject_SetAttr(appender, str_next_step, after) < 0) {
        goto done;
    }
    result = row;
    row = NULL;
done:
    Py_XDECREF(repeat);
    Py_XDECREF(table);
    Py_XDECREF(names);
    Py_XDECREF(next_step);
    Py_XDECREF(n);
    Py_XDECREF(row);
    Py_XDECREF(after);
    return result;
}

/* _table.Table.append_at without its bulk move: stage(table, n, step, row,
 * limit) -> 0 (another state appended first: nothing done), 1 (staged) or
 * 2 (staged, and ``limit`` rows are staged: move them). Under table.lock. */
static PyObject *
stage(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "stage() takes 5 arguments");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[4]);
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int full = 0;
    int staged = stage_row(args[0], args[1], args[2], args[3], limit, 0, &full);
    if (staged < 0) {
        return NULL;
    }
    return PyLong_FromLong(staged + full);
}

static PyObject *str_data, *str_tables, *str_ptypes, *str_attrs, *str__inflight;
static PyObject *str__index, *str__meta, *str_all_steps;

/* _history_state.HistoryState.update for the common case: state_update(state,
 * metrics, consts) -> the new HistoryState, or NotImplemented (nothing done:
 * HistoryState.update runs). ``consts`` is (last, row_type, finite_kind,
 * all_floats, limit, new_state, new_tables): ``last`` the one-item list
 * holding parse_row's Repeat. The case: ``metrics`` parses through
 * repeated() (a dict with the keys of the last one, finite floats, no step or
 * a step entry past next_step), its names have a float64 table with rows
 * (ptypes is all_floats) and this state owns the table's end; the row is
 * staged in place, as _appending.appended does, and the state derived with
 * the same index, as HistoryState._derive(..., same=True) does. */
static PyObject *
state_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 7) {
        PyErr_SetString(PyExc_TypeError, "state_update() takes 3 arguments");
        return NULL;
    }
    PyObject *state = args[0], *metrics = args[1], *consts = args[2];
    PyObject *last = PyTuple_GET_ITEM(consts, 0);
    Py_ssize_t limit = PyLong_AsSsize_t(PyTuple_GET_ITEM(consts, 4));
    if (limit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyDict_CheckExact(metrics) || !PyList_CheckExact(last) ||
        PyList_GET_SIZE(last) != 1) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *repeat = Py_NewRef(PyList_GET_ITEM(last, 0));
    PyObject *result = NULL, *data = NULL, *tables = NULL, *next_step = NULL;
    PyObject *row = NULL, *ptypes = NULL, *copy = NULL, *entry = NULL;
    PyObject *after = NULL, *n_after = NULL, *new_data = NULL, *new_state = NULL;
    PyObject *index = NULL, *meta = NULL, *attrs = NULL, *inflight = NULL;
    if (repeat == Py_None || !PyTuple_Check(repeat) || PyTuple_GET_SIZE(repeat) != 3) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *names = PyTuple_GET_ITEM(repeat, 1);
    if (!PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) == 0) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    data = PyObject_GetAttr(state, str_data);
    tables = data ? PyObject_GetAttr(data, str_tables) : NULL;
    next_step = tables ? PyObject_GetAttr(state, str_next_step) : NULL;
    if (next_step == NULL) {
        goto done;
    }
    if (!PyDict_CheckExact(tables) || !PyLong_CheckExact(next_step)) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *found = PyDict_GetItemWithError(tables, names); /* borrowed */
    if (found == NULL) {
        result = PyErr_Occurred() ? NULL : Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 2) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *table = PyTuple_GET_ITEM(found, 0), *n = PyTuple_GET_ITEM(found, 1);
    entry = Py_NewRef(found); /* (keeps table and n alive) */
    ptypes = PyLong_CheckExact(n) ? PyObject_GetAttr(table, str_ptypes) : NULL;
    if (ptypes == NULL) {
        /* not a Table (a tree transformation's placeholders): the Python
         * path says what is wrong */
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
            goto done;
        }
        PyErr_Clear();
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    /* a table with rows: a first row derives the index (Tables.carry) */
    int has_rows = PyObject_RichCompareBool(n, int_zero, Py_GT);
    if (has_rows < 0) {
        goto done;
    }
    if (ptypes != PyTuple_GET_ITEM(consts, 3) || !has_rows) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *zero = PyFloat_FromDouble(0.0);
    if (zero == NULL) {
        goto done;
    }
    PyObject *parse_args[7] = {repeat,   metrics, next_step, zero, Py_None,
                               PyTuple_GET_ITEM(consts, 1), PyTuple_GET_ITEM(consts, 2)};
    row = repeated(NULL, parse_args, 7);
    Py_DECREF(zero);
    if (row == NULL) {
        goto done;
    }
    if (row == Py_None) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    PyObject *step = PyTuple_GET_ITEM(row, 0);
    int full = 0;
    int staged = stage_row(table, n, step, PyTuple_GET_ITEM(row, 2), limit, 1, &full);
    if (staged <= 0) { /* 0: another state appended first: copy (Python) */
        result = staged == 0 ? Py_NewRef(Py_NotImplemented) : NULL;
        goto done;
    }
    /* staged: from here on an error leaves a row no state sees, as an error
     * after Table.append_at does in the Python form */
    n_after = PyNumber_Add(n, int_one);
    after = n_after ? PyNumber_Add(step, int_one) : NULL;
    copy = after ? PyDict_Copy(tables) : NULL;
    if (copy == NULL) {
        goto done;
    }
    PyObject *pair = PyTuple_Pack(2, table, n_after);
    if (pair == NULL) {
        goto done;
    }
    int failed = PyDict_SetItem(copy, names, pair);
    Py_DECREF(pair);
    index = failed ? NULL : PyObject_GetAttr(data, str__index);
    meta = index ? PyObject_GetAttr(data, str__meta) : NULL;
    attrs = meta ? PyObject_GetAttr(state, str_attrs) : NULL;
    inflight = attrs ? PyObject_GetAttr(state, str__inflight) : NULL;
    new_data = inflight ? PyObject_CallNoArgs(PyTuple_GET_ITEM(consts, 6)) : NULL;
    if (new_data == NULL || PyObject_SetAttr(new_data, str_tables, copy) < 0 ||
        PyObject_SetAttr(new_data, str_all_steps, Py_None) < 0 ||
        PyObject_SetAttr(new_data, str__index, index) < 0 ||
        PyObject_SetAttr(new_data, str__meta, meta) < 0) {
        goto done;
    }
    new_state = PyObject_CallNoArgs(PyTuple_GET_ITEM(consts, 5));
    if (new_state == NULL || PyObject_GenericSetAttr(new_state, str_data, new_data) < 0 ||
        PyObject_GenericSetAttr(new_state, str_next_step, after) < 0 ||
        PyObject_GenericSetAttr(new_state, str_attrs, attrs) < 0 ||
        PyObject_GenericSetAttr(new_state, str__inflight, inflight) < 0) {
        goto done;
    }
    result = new_state;
    new_state = NULL;
done:
    Py_XDECREF(repeat);
    Py_XDECREF(data);
    Py_XDECREF(tables);
    Py_XDECREF(next_step);
    Py_XDECREF(row);
    Py_XDECREF(ptypes);
    Py_XDECREF(copy);
    Py_XDECREF(entry);
    Py_XDECREF(after);
    Py_XDECREF(n_after);
    Py_XDECREF(new_data);
    Py_XDECREF(new_state);
    Py_XDECREF(index);
    Py_XDECREF(meta);
    Py_XDECREF(attrs);
    Py_XDECREF(inflight);
    return result;
}

/* _codec.encode_records' assembly for one column of metrics:
 * lines(bodies, both, k, head0, head1, head2, end) -> bytes | None.
 *
 * ``bodies`` is orjson's text of k dicts (b'[{...},{...}]'), ``both`` its
 * text of [steps, stamps] (b'[[1,2],[0.5,null]]'). Line i is head0, step i,
 * head1, stamp i, head2, dict i without its braces, end. None where the text
 * does not split into k parts (a name holding '},{'). */
static PyObject *
lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "lines() takes 7 arguments");
        return NULL;
    }
    for (int i = 0; i < 7; i++) {
        if (i != 2 && !PyBytes_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "lines() takes bytes");
            return NULL;
        }
    }
    Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    if (k == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const char *body = PyBytes_AS_STRING(args[0]);
    Py_ssize_t body_n = PyBytes_GET_SIZE(args[0]);
    const char *both = PyBytes_AS_STRING(args[1]);
    Py_ssize_t both_n = PyBytes_GET_SIZE(args[1]);
    if (k <= 0 || body_n < 4 || memcmp(body, "[{", 2) != 0 ||
        memcmp(body + body_n - 2, "}]", 2) != 0 || both_n < 6 ||
        memcmp(both, "[[", 2) != 0 || memcmp(both + both_n - 2, "]]", 2) != 0) {
        Py_RETURN_NONE;
    }
    Py_ssize_t fixed = PyBytes_GET_SIZE(args[3]) + PyBytes_GET_SIZE(args[4]) +
                       PyBytes_GET_SIZE(args[5]) + PyBytes_GET_SIZE(args[6]);
    PyObject *out = PyBytes_FromStringAndSize(NULL, body_n + both_n + k * fixed);
    if (out == NULL) {
        return NULL;
    }
    char *at = PyBytes_AS_STRING(out);
    const char *b = body + 2, *b_end = body + body_n - 2;   /* inside [{ }] */
    const char *s = both + 2, *both_end = both + both_n - 2; /* inside [[ ]] */
    const char *t = memchr(s, ']', both_end - s);           /* steps end */
    if (t == NULL || t + 2 > both_end || t[1] != ',' || t[2] != '[') {
        goto none;
    }
    const char *steps_end = t, *u = t + 3; /* stamps start */
    for (Py_ssize_t i = 0; i < k; i++) {
        /* step i: up to ',' or the end of the steps */
        const char *step_end = s;
        while (step_end < steps_end && *step_end != ',') {
            step_end++;
        }
        const char *stamp_end = u;
        while (stamp_end < both_end && *stamp_end != ',') {
            stamp_end++;
        }
        /* dict i: up to the next '},{' (the last: to the end) */
        const char *d_end = NULL;
        for (const char *c = b; c + 2 < b_end; c++) {
            if (c[0] == '}' && c[1] == ',' && c[2] == '{') {
                d_end = c;
                break;
            }
        }
        /* k - 1 separators in all, as many as the dicts need */
        if ((d_end == NULL) != (i == k - 1)) {
            goto none;
        }
        if (d_end == NULL) {
            d_end = b_end;
        }
        if (step_end == s || stamp_end == u ||
            (i == k - 1) != (step_end == steps_end) ||
            (i == k - 1) != (stamp_end == both_end)) {
            goto none;
        }
        PyObject *parts[4] = {args[3], args[4], args[5], args[6]};
        const char *texts[3] = {s, u, b};
        Py_ssize_t sizes[3] = {step_end - s, stamp_end - u, d_end - b};
        for (int j = 0; j < 4; j++) {
            Py_ssize_t n = PyBytes_GET_SIZE(parts[j]);
            memcpy(at, PyBytes_AS_STRING(parts[j]), n);
            at += n;
            if (j < 3) {
                memcpy(at, texts[j], sizes[j]);
                at += sizes[j];
            }
        }
        s = step_end + 1;
        u = stamp_end + 1;
        b = d_end + 3;
    }
    if (_PyBytes_Resize(&out, at - PyBytes_AS_STRING(out)) < 0) {
        return NULL;
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyObject *str__closed, *str__queue, *str__wake_thread;
static PyObject *str_WAKE_AT, *str_MAX_PENDING, *str__backpressure;

/* _writer.Writer.add: add(writer, item, closed_error) -> None. Queues
 * ``item`` under writer._lock; raises ``closed_error`` once the writer is
 * closed; wakes the thread at WAKE_AT items and waits (back-pressure) at
 * MAX_PENDING, as Writer.add does. */
static PyObject *
add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add() takes 3 arguments");
        return NULL;
    }
    PyObject *writer = args[0], *item = args[1];
    /* Without the writer's lock: from reading _closed to the append, nothing
     * here runs Python code (plain instance attributes, a list append, no
     * reference dropped to zero), so no other thread runs in between (the
     * GIL, which this module never declares it can do without), and a
     * close() or a _take() on another thread sees the item queued before it
     * or the writer closed, as with the lock. */
    Py_ssize_t n = -1;
    PyObject *closed = PyObject_GetAttr(writer, str__closed);
    int is_closed = closed == NULL ? -1 : PyObject_IsTrue(closed);
    Py_XDECREF(closed);
    if (is_closed == 1) {
        PyErr_SetString(args[2], "the writer is closed");
    }
    else if (is_closed == 0) {
        PyObject *queue = PyObject_GetAttr(writer, str__queue);
        if (queue != NULL) {
            if (!PyList_CheckExact(queue)) {
                PyErr_SetString(PyExc_TypeError, "a writer's queue must be a list");
            }
            else if (PyList_Append(queue, item) == 0) {
                n = PyList_GET_SIZE(queue);
            }
            Py_DECREF(queue);
        }
    }
    if (n < 0) {
        return NULL;
    }
    PyObject *limit = PyObject_GetAttr(writer, str_WAKE_AT);
    Py_ssize_t wake_at = limit ? PyLong_AsSsize_t(limit) : -1;
    Py_XDECREF(limit);
    if (wake_at == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n == wake_at) { /* (the thread then takes every item queued) */
        PyObject *done = PyObject_CallMethodNoArgs(writer, str__wake_thread);
        if (done == NULL) {
            return NULL;
        }
        Py_DECREF(done);
        Py_RETURN_NONE;
    }
    limit = PyObject_GetAttr(writer, str_MAX_PENDING);
    Py_ssize_t most = limit ? PyLong_AsSsize_t(limit) : -1;
    Py_XDECREF(limit);
    if (most == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n >= most) {
        return PyObject_CallMethodNoArgs(writer, str__backpressure);
    }
    Py_RETURN_NONE;
}

static PyObject *str_side, *str_due, *str_guard, *str_out, *str_writing;
static PyObject *str_writer, *str_rec, *str_updates, *str_stamp_steps;
static PyObject *str_stamp_times, *str_append, *str_failed, *str_add;

/* Calls method ``name`` of ``obj`` with one argument; -1 on an error. */
static int
call_one(PyObject *obj, PyObject *name, PyObject *arg)
{
    PyObject *r = PyObject_CallMethodOneArg(obj, name, arg);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* After the row is recorded: counts the update, stamps its step and time and
 * queues its log line (``writer``: NULL, not logged). 0 or -1 (an error). */
static int
stamp_and_queue(PyObject *recorder, PyObject *out, PyObject *writer,
                PyObject *metrics, PyObject *row, PyObject *now,
                PyObject *closed_error)
{
    PyObject *updates = PyObject_GetAttr(recorder, str_updates);
    PyObject *more = updates ? PyNumber_Add(updates, int_one) : NULL;
    Py_XDECREF(updates);
    int failed = more == NULL || PyObject_SetAttr(recorder, str_updates, more) < 0;
    Py_XDECREF(more);
    if (failed) {
        return -1;
    }
    PyObject *step = PyTuple_GET_ITEM(row, 0);
    PyObject *steps = PyObject_GetAttr(out, str_stamp_steps);
    failed = steps == NULL || call_one(steps, str_append, step) < 0;
    Py_XDECREF(steps);
    if (failed) {
        return -1;
    }
    PyObject *times = PyObject_GetAttr(out, str_stamp_times);
    failed = times == NULL || call_one(times, str_append, now) < 0;
    Py_XDECREF(times);
    if (failed || writer == NULL) {
        return failed ? -1 : 0;
    }
    PyObject *queued_args[4] = {metrics, NULL, step, now};
    PyObject *k = PyLong_FromSsize_t(PyTuple_GET_SIZE(PyTuple_GET_ITEM(row, 1)));
    if (k == NULL) {
        return -1;
    }
    queued_args[1] = k;
    PyObject *item = queued(NULL, queued_args, 4);
    Py_DECREF(k);
    if (item == NULL) {
        return -1;
    }
    PyObject *add_args[3] = {writer, item, closed_error};
    PyObject *added = add(NULL, add_args, 3);
    if (added == NULL && PyErr_ExceptionMatches(closed_error)) {
        /* a close a Ctrl-C cut short: RunLog.add completes it first */
        PyErr_Clear();
        added = PyObject_CallMethodOneArg(out, str_add, item);
    }
    Py_DECREF(item);
    Py_XDECREF(added);
    return added == NULL ? -1 : 0;
}

/* _recorder.Recorder.update's common case, whole, under recorder.lock:
 * update(recorder, metrics, step, consts) -> Row | NotImplemented, where
 * ``consts`` is (row_type, finite_kind, stage_limit, time.time,
 * _trace_state.active, WriterClosed). A dict like the last one, of finite
 * floats, with no side values due, no sentinels and (where logged) the log's
 * writer started: parsed, appended, stamped and queued, and its row
 * returned. NotImplemented, with nothing done, for anything else. */
static PyObject *
update(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) != 6) {
        PyErr_SetString(PyExc_TypeError, "update() takes 4 arguments");
        return NULL;
    }
    PyObject *recorder = args[0], *metrics = args[1], *step = args[2];
    PyObject *consts = args[3];
    PyObject *row_type = PyTuple_GET_ITEM(consts, 0);
    PyObject *finite_kind = PyTuple_GET_ITEM(consts, 1);
    PyObject *limit = PyTuple_GET_ITEM(consts, 2);
    PyObject *clock = PyTuple_GET_ITEM(consts, 3);
    PyObject *trace_active = PyTuple_GET_ITEM(consts, 4);
    PyObject *closed_error = PyTuple_GET_ITEM(consts, 5);
    if (!PyDict_CheckExact(metrics)) {
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *lock = acquire(recorder, str_lock);
    if (lock == NULL) {
        return NULL;
    }
    PyObject *result = NULL, *side = NULL, *due = NULL, *guard = NULL;
    PyObject *out = NULL, *writing = NULL, *writer = NULL, *now = NULL;
    PyObject *rec = NULL, *row = NULL;
    side = PyObject_GetAttr(recorder, str_side);
    due = side ? PyObject_GetAttr(side, str_due) : NULL;
    guard = due ? PyObject_GetAttr(recorder, str_guard) : NULL;
    out = guard ? PyObject_GetAttr(recorder, str_out) : NULL;
    writing = out ? PyObject_GetAttr(out, str_writing) : NULL;
    if (writing == NULL) {
        goto done;
    }
    int busy = PyObject_IsTrue(due);
    if (busy < 0) {
        goto done;
    }
    if (busy || guard != Py_None) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    int logged = PyObject_IsTrue(writing);
    if (logged < 0) {
        goto done;
    }
    if (!logged) {
        PyObject *handler = PyObject_CallNoArgs(trace_active);
        if (handler == NULL) {
            goto done;
        }
        logged = handler != Py_None;
        Py_DECREF(handler);
    }
    if (logged) {
        writer = PyObject_GetAttr(out, str_writer);
        if (writer == NULL) {
            goto done;
        }
        if (writer == Py_None) { /* the first line starts the writer: take */
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
    }
    now = PyObject_CallNoArgs(clock);
    rec = now ? PyObject_GetAttr(recorder, str_rec) : NULL;
    if (rec == NULL) {
        goto done;
    }
    PyObject *take_args[7] = {rec, metrics, now, step, row_type, finite_kind, limit};
    row = take(NULL, take_args, 7);
    if (row == NULL) {
        goto done;
    }
    if (row == Py_None || row == Py_NotImplemented) {
        result = Py_NewRef(Py_NotImplemented);
        goto done;
    }
    if (stamp_and_queue(recorder, out, writer, metrics, row, now, closed_error) < 0) {
        /* recorded, maybe not queued: finalize writes the log from the state */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        if (PyObject_SetAttr(out, str_failed, Py_True) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, tb);
        goto done;
    }
    result = row;
    row = NULL;
done:
    Py_XDECREF(side);
    Py_XDECREF(due);
    Py_XDECREF(guard);
    Py_XDECREF(out);
    Py_XDECREF(writing);
    Py_XDECREF(writer);
    Py_XDECREF(now);
    Py_XDECREF(rec);
    Py_XDECREF(row);
    if (release(lock) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"repeated", (PyCFunction)(void (*)(void))repeated, METH_FASTCALL,
     "repeated(repeat, metrics, next_step, timestamp, step, row_type, "
     "finite_kind) -> Row | None (see jaxhistory._row.repeated)"},
    {"update", (PyCFunction)(void (*)(void))update, METH_FASTCALL,
     "update(recorder, metrics, step, consts) -> Row | NotImplemented (see "
     "jaxhistory._recorder.Recorder.update)"},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "take(appender, metrics, timestamp, step, row_type, finite_kind, limit) "
     "-> Row | None | NotImplemented (see "
     "jaxhistory._history_state.Appender.take)"},
    {"stage", (PyCFunction)(void (*)(void))stage, METH_FASTCALL,
     "stage(table, n, step, row, limit) -> 0, 1 or 2 (see "
     "jaxhistory._table.Table.append_at)"},
    {"state_update", (PyCFunction)(void (*)(void))state_update, METH_FASTCALL,
     "state_update(state, metrics, consts) -> HistoryState | NotImplemented "
     "(see jaxhistory._history_state.HistoryState.update)"},
    {"queued", (PyCFunction)(void (*)(void))queued, METH_FASTCALL,
     "queued(metrics, k, step, timestamp) -> (dict, step, timestamp) (see "
     "jaxhistory._row.queued)"},
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL,
     "add(writer, item, closed_error) -> None (see "
     "jaxhistory._writer.Writer.add)"},
    {"move_floats", (PyCFunction)move_floats_py, METH_O,
     "move_floats(table) -> bool: Table.move_stage for float64 scalar rows of "
     "Python floats; False: nothing done (see jaxhistory._table)"},
    {"lines", (PyCFunction)(void (*)(void))lines, METH_FASTCALL,
     "lines(bodies, both, k, head0, head1, head2, end) -> bytes | None (see "
     "jaxhistory._codec.encode_records)"},
    {"fixed_line", (PyCFunction)(void (*)(void))fixed_line, METH_FASTCALL,
     "fixed_line(pieces, step, values, precision) -> str | None (see "
     "jaxhistory._summary.SummaryLine.format_floats)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_speedups",
    .m_doc = "Compiled forms of the host path's busiest steps (see _speedups.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    step_label = PyUnicode_InternFromString("step");
    str_lock = PyUnicode_InternFromString("lock");
    str_length = PyUnicode_InternFromString("length");
    str_rows = PyUnicode_InternFromString("rows");
    str_row_steps = PyUnicode_InternFromString("row_steps");
    str_last_step = PyUnicode_InternFromString("last_step");
    str_acquire = PyUnicode_InternFromString("acquire");
    str_release = PyUnicode_InternFromString("release");
    str_step = step_label;
    str_repeat = PyUnicode_InternFromString("_repeat");
    str_table = PyUnicode_InternFromString("_table");
    str_names = PyUnicode_InternFromString("_names");
    str_n = PyUnicode_InternFromString("_n");
    str_next_step = PyUnicode_InternFromString("next_step");
    str_move_stage = PyUnicode_InternFromString("move_stage");
    if (!str_repeat || !str_table || !str_names || !str_n || !str_next_step ||
        !str_move_stage) {
        return NULL;
    }
    str__closed = PyUnicode_InternFromString("_closed");
    str__queue = PyUnicode_InternFromString("_queue");
    str__wake_thread = PyUnicode_InternFromString("_wake_thread");
    str_WAKE_AT = PyUnicode_InternFromString("WAKE_AT");
    str_MAX_PENDING = PyUnicode_InternFromString("MAX_PENDING");
    str__backpressure = PyUnicode_InternFromString("_backpressure");
    if (!str__closed || !str__queue || !str__wake_thread ||
        !str_WAKE_AT || !str_MAX_PENDING || !str__backpressure) {
        return NULL;
    }
    str_device_rows = PyUnicode_InternFromString("device_rows");
    str_scalar_dtype = PyUnicode_InternFromString("scalar_dtype");
    str_values = PyUnicode_InternFromString("values");
    str_steps = PyUnicode_InternFromString("steps");
    str_fill = PyUnicode_InternFromString("fill");
    str__reserve = PyUnicode_InternFromString("_reserve");
    str_kind = PyUnicode_InternFromString("kind");
    str_itemsize = PyUnicode_InternFromString("itemsize");
    if (!str_device_rows || !str_scalar_dtype || !str_values || !str_steps ||
        !str_fill || !str__reserve || !str_kind || !str_itemsize) {
        return NULL;
    }
    str_data = PyUnicode_InternFromString("data");
    str_tables = PyUnicode_InternFromString("tables");
    str_ptypes = PyUnicode_InternFromString("ptypes");
    str_attrs = PyUnicode_InternFromString("attrs");
    str__inflight = PyUnicode_InternFromString("_inflight");
    str__index = PyUnicode_InternFromString("_index");
    str__meta = PyUnicode_InternFromString("_meta");
    str_all_steps = PyUnicode_InternFromString("all_steps");
    if (!str_data || !str_tables || !str_ptypes || !str_attrs || !str__inflight ||
        !str__index || !str__meta || !str_all_steps) {
        return NULL;
    }
    str_side = PyUnicode_InternFromString("side");
    str_due = PyUnicode_InternFromString("due");
    str_guard = PyUnicode_InternFromString("guard");
    str_out = PyUnicode_InternFromString("out");
    str_writing = PyUnicode_InternFromString("writing");
    str_writer = PyUnicode_InternFromString("writer");
    str_rec = PyUnicode_InternFromString("rec");
    str_updates = PyUnicode_InternFromString("updates");
    str_stamp_steps = PyUnicode_InternFromString("stamp_steps");
    str_stamp_times = PyUnicode_InternFromString("stamp_times");
    str_append = PyUnicode_InternFromString("append");
    str_failed = PyUnicode_InternFromString("failed");
    str_add = PyUnicode_InternFromString("add");
    if (!str_side || !str_due || !str_guard || !str_out || !str_writing ||
        !str_writer || !str_rec || !str_updates || !str_stamp_steps ||
        !str_stamp_times || !str_append || !str_failed || !str_add) {
        return NULL;
    }
    int_zero = PyLong_FromLong(0);
    int_one = PyLong_FromLong(1);
    if (!step_label || !str_lock || !str_length || !str_rows || !str_row_steps ||
        !str_last_step || !str_acquire || !str_release || !int_zero || !int_one) {
        return NULL;
    }
    return PyModule_Create(&module);
}
