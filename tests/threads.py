"""Running a test's torch work on a thread of its own: torch's thread counts are per thread."""
import threading


def on_a_thread(work):
    """work() on a new thread; its return value."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    thread.start()
    thread.join()
    return result["value"]
