"""Generator of a small synthetic WebShop catalogue in the file formats the real ``web_agent_site`` reads.

WebShop's own product data is a web scrape with no clear license, so we ship this generator instead. It writes,
into one data folder:

* ``items_shuffle.json`` — list of products: ``asin`` (10 characters), ``name``, ``full_description``,
  ``small_description`` (bullet list), ``pricing`` (``"$12.99"``), ``customization_options``
  (``{"color": [{"value", "image"}], "size": [...]}``), ``images``, ``category``, ``query``, ``product_category``
  (``"A › B › C"``);
* ``items_ins_v2.json`` — ``{asin: {"attributes", "instruction", "instruction_attributes"}}``;
* ``items_human_ins.json`` — ``{asin: [{"asin", "instruction", "instruction_attributes", "instruction_options"}]}``
  (one goal per product; the real engine's ``human_goals=True`` reads these);
* ``reviews.json`` — ``[{"asin", "reviews": [], "average_rating"}]``;
* ``index_docs/documents.jsonl`` — one ``{"id": asin, "contents": text}`` per product, the input of the Lucene
  index that the real engine searches.

Build the index (real engine only; needs ``pyserini`` and Java >= 21)::

    OPENAI_API_KEY=dummy python -m pyserini.index.lucene --collection JsonCollection \\
        --input DATA/index_docs --index DATA/indexes --generator DefaultLuceneDocumentGenerator \\
        --threads 1 --storePositions --storeDocvectors --storeRaw

Command line: ``python -m sandbox_adapters.webshop.data DATA_DIR [--num N] [--seed S]``. The output is identical
for the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Any

__all__ = ["FILES", "generate_catalogue"]

#: role -> file name inside the data folder
FILES = {
    "products": "items_shuffle.json",
    "attributes": "items_ins_v2.json",
    "human_instructions": "items_human_ins.json",
    "reviews": "reviews.json",
    "index_docs": "index_docs/documents.jsonl",
    "index": "indexes",
}

# (query, product noun, category path, attribute pool, colors, sizes)
_KINDS: tuple[tuple[str, str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    ("running shoes", "running shoes", "Clothing, Shoes & Jewelry › Men › Shoes › Athletic",
     ("lightweight", "non slip", "breathable", "arch support"), ("black", "blue", "grey"), ("8", "9", "10", "11")),
    ("t shirt", "cotton t-shirt", "Clothing, Shoes & Jewelry › Women › Clothing › Tops",
     ("machine wash", "short sleeve", "relaxed fit", "organic cotton"), ("white", "red", "navy"), ("small", "medium",
                                                                                                  "large")),
    ("coffee mug", "ceramic coffee mug", "Home & Kitchen › Kitchen & Dining › Drinkware › Mugs",
     ("dishwasher safe", "microwave safe", "large capacity", "gift box"), ("white", "black", "green"), ("12 oz",
                                                                                                      "16 oz")),
    ("backpack", "travel backpack", "Luggage & Travel Gear › Backpacks › Casual Daypacks",
     ("water resistant", "laptop compartment", "usb charging port", "anti theft"), ("black", "grey", "olive"),
     ("20l", "30l")),
    ("headphones", "wireless headphones", "Electronics › Headphones › Over-Ear Headphones",
     ("noise cancelling", "long battery life", "foldable", "built-in microphone"), ("black", "silver", "rose gold"),
     ("one size",)),
)
_BRANDS = ("Northpeak", "Velora", "Kestrel", "Amberline", "Tidewell", "Corvo", "Lumen & Co", "Brightfold")


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))


def _product(rng: random.Random, index: int) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    query, noun, path, attr_pool, colors, sizes = _KINDS[index % len(_KINDS)]
    brand = _BRANDS[index % len(_BRANDS)]
    attributes = sorted(rng.sample(attr_pool, 2))
    asin = _asin(rng)
    price = round(rng.uniform(9, 95), 2)
    name = f"{brand} {attributes[0]} {noun} with {attributes[1]}"
    product = {
        "asin": asin,
        "name": name,
        "full_description": f"The {brand} {noun} is {attributes[0]} and offers {attributes[1]}. "
                            f"A dependable choice for everyday use.",
        "small_description": [f"{a.capitalize()}." for a in attributes] + [f"Made by {brand}."],
        "pricing": f"${price:.2f}",
        "customization_options": {
            "color": [{"value": c, "image": None} for c in colors],
            "size": [{"value": s, "image": None} for s in sizes],
        },
        "images": [f"https://images.invalid/{asin}.jpg"],
        "category": path.split(" › ")[0].lower(),
        "query": query,
        "product_category": path,
    }
    color, size = rng.choice(colors), rng.choice(sizes)
    goal = {
        "asin": asin,
        "instruction": f"i am looking for {attributes[0]} {noun} with {attributes[1]}, color {color}, size {size}",
        "instruction_attributes": attributes,
        "instruction_options": [color, size],
    }
    return product, attributes, goal


def generate_catalogue(data_dir: str, num: int = 30, seed: int = 0) -> list[dict[str, Any]]:
    """Write ``num`` products and one goal per product into ``data_dir``; return the products."""
    rng = random.Random(seed)
    products, attrs, human, reviews = [], {}, {}, []
    for i in range(num):
        product, attributes, goal = _product(rng, i)
        asin = product["asin"]
        products.append(product)
        attrs[asin] = {"attributes": attributes, "instruction": goal["instruction"],
                       "instruction_attributes": attributes}
        human[asin] = [goal]
        reviews.append({"asin": asin, "reviews": [], "average_rating": "N.A."})
    os.makedirs(os.path.join(data_dir, os.path.dirname(FILES["index_docs"])), exist_ok=True)
    for role, payload in (("products", products), ("attributes", attrs), ("human_instructions", human),
                          ("reviews", reviews)):
        with open(os.path.join(data_dir, FILES[role]), "w") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
    with open(os.path.join(data_dir, FILES["index_docs"]), "w") as f:
        for p in products:
            text = " ".join([p["name"], p["full_description"], *p["small_description"]])
            f.write(json.dumps({"id": p["asin"], "contents": text}) + "\n")
    return products


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data_dir")
    parser.add_argument("--num", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generate_catalogue(args.data_dir, args.num, args.seed)


if __name__ == "__main__":
    _main()
