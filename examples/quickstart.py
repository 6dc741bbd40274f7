"""The README example: charge an order once, however often it is sent (Redis, redis-py)."""

from celery import Celery, Task

from idempotent_tasks import IdempotentTask

app = Celery("shop", broker="redis://localhost:6379/0", backend="redis://localhost:6379/1")
app.conf.idempotency_store_url = "redis://localhost:6379/2"  # claims + cached results


@app.task(
    name="shop.charge", base=IdempotentTask, bind=True, autoretry_for=(TimeoutError,), max_retries=3
)
def charge(self: Task, order_id: int, amount: int) -> dict[str, object]:
    """Charge ``amount`` cents for ``order_id``: runs to success at most once per key."""
    return {"charge_id": f"ch_{self.request.id}", "amount": amount}


if __name__ == "__main__":
    first = charge.apply_async((42, 990), idempotency_key="order-42")
    again = charge.s(42, 990).set(idempotency_key="order-42").delay()  # canvas too
    print(first.get(timeout=10) == again.get(timeout=10))  # True: one charge, one value
