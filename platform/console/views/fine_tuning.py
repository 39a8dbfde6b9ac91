"""Fine-tuning jobs of a tenant: the list, and the selected job's loss curve (an SVG drawn here) and events."""

from django.http import Http404
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from console.access import Role, tenant_page
from console.charts import AXIS_CHAR, axis_margin, nice_ceiling, quarter_grid
from console.listing import listing
from console.pages import render_page
from finetuning.selectors import events_of, job_get, jobs_of, loss_curve

WIDTH, HEIGHT = 760, 240
LEFT, RIGHT, TOP, BOTTOM = 52, 24, 14, 42
SORTABLE = {"created": ("created_at", "id"), "status": ("status", "id")}


def _polyline(points: list[tuple[int, float]], x_of, y_of) -> str:
    return " ".join(f"{'M' if i == 0 else 'L'}{x_of(s):.1f},{y_of(v):.1f}" for i, (s, v) in enumerate(points))


def loss_chart(curve: list[dict], *, total_steps: int) -> SafeString:
    """Training loss per step as a line, validation loss where measured as dots, on one loss axis."""
    train = [(row["step"], float(row["train_loss"])) for row in curve if row.get("train_loss") is not None]
    valid = [(row["step"], float(row["valid_loss"])) for row in curve if row.get("valid_loss") is not None]
    if not train:
        return mark_safe("")
    top = nice_ceiling(max(v for _, v in train + valid))
    ticks = [f"{top * (1 - i / 4):.3g}" for i in range(5)]
    left = axis_margin(ticks, minimum=LEFT, char_width=AXIS_CHAR)  # room for the ticks at a phone's font
    plot_w, plot_h = WIDTH - left - RIGHT, HEIGHT - TOP - BOTTOM
    steps = max(total_steps, train[-1][0], 1)

    def x_of(step: int) -> float:
        return left + plot_w * step / steps

    def y_of(value: float) -> float:
        return TOP + plot_h * (1 - value / top)

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="Training and validation '
             f'loss" data-steps="{len(train)}" data-validations="{len(valid)}">']  # fmt: skip
    parts += quarter_grid(x1=left, x2=WIDTH - RIGHT, plot_h=plot_h, ticks=ticks, tick_x=2)
    for i in range(5):
        step = round(steps * i / 4)
        anchor = "end" if i == 4 else "middle"
        parts.append(f'<text class="axis x" x="{x_of(step):.1f}" y="{HEIGHT - 6}" text-anchor="{anchor}">{step}</text>')
    parts.append(f'<path class="loss-train" fill="none" stroke="#4f46e5" stroke-width="2" d="{_polyline(train, x_of, y_of)}">'
                 f'<title>training loss, last {train[-1][1]:.4f}</title></path>')  # fmt: skip
    for step, value in valid:
        title = escape(f"step {step}: validation loss {value:.4f}")
        parts.append(f'<circle class="dot loss-valid" cx="{x_of(step):.1f}" cy="{y_of(value):.1f}" r="3"><title>{title}'
                     "</title></circle>")  # fmt: skip
    parts.append("</svg>")
    return mark_safe("".join(parts))


@tenant_page(Role.VIEWER)
def fine_tuning(request):
    tenant = request.seat.tenant
    page = listing(request, jobs_of(tenant=tenant), sortable=SORTABLE, default_sort="-created")
    chosen = request.GET.get("job") or (page.rows[0].public_id if page.rows else None)
    job = job_get(tenant=tenant, public_id=chosen) if chosen else None
    if chosen and job is None:
        raise Http404("No such fine-tuning job.")
    rows = [(row, page.url_with(job=row.public_id)) for row in page.rows]
    context = {"jobs": page, "rows": rows, "job": job}
    if job is not None:
        curve = loss_curve(job=job)
        context |= {
            "chart": loss_chart(curve, total_steps=job.total_steps),
            "validated": any(row.get("valid_loss") is not None for row in curve),
            "events": list(events_of(job=job).exclude(kind="metrics")[:20]),
        }
    return render_page(request, "console/fine_tuning.html", context, section="fine-tuning")
